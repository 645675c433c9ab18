"""Pick a transformer shape for a parameter target. Pure Python: no jax import.

The model (slm/model/transformer.py) is a decoder-only transformer with a tied embedding, no biases,
RMSNorm (a scale vector only), fused QKV attention and a SwiGLU MLP. Its exact parameter count:

    N = V*D                      tied token embedding (also the output projection)
      + L * (4*D*D               q, k, v, o projections (n_heads * head_dim == D)
             + 3*D*F             SwiGLU gate, up (D x F each) and down (F x D)
             + 2*D)              two RMSNorm scales per block
      + D                        final RMSNorm scale

Sizing rule (`choose_shape`):
  * width D is a multiple of 32; head_dim is 32 below D=512 and 64 from there (heads = D / head_dim);
  * depth is favoured over width for small models: among shapes that can hit the target we prefer
    the one whose aspect ratio D/L is closest to 32 (e.g. 4x128, 8x256, 20x640), as MobileLLM found
    deep-and-thin better at small scale;
  * the MLP width F absorbs the remainder: F is solved for, rounded to a multiple of 8 and kept within
    [2D, 4D] (the classic SwiGLU value is 8D/3), which makes the count land within a fraction of a
    percent of the target across 100K-100M parameters.

FLOPs per token (training, forward + backward), as in PaLM / nanoGPT:
    6*N + 12*L*D*S     (S = sequence length; the attention score and value matmuls)
The 6*N term counts the tied output projection (2*V*D per token forward) through the embedding's
share of N; the lookup itself is free but the output matmul is not, so this is exact for tied weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from slm.errors import SizingError

ASPECT = 32.0  # preferred width / depth ratio
TOLERANCE = 0.05


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    # Pretrained families (Llama, Mistral, Qwen2) differ from this trainer's own shapes in these; the
    # defaults are its own model, whose parameter tree and arithmetic they leave exactly as they were.
    n_kv_heads: int | None = None  # grouped-query attention: key/value heads (None: n_heads)
    head_size: int | None = None  # per-head width when it is not d_model / n_heads
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    tie_embeddings: bool = True  # the output projection is the token embedding
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qk_norm: bool = False  # an RMSNorm over each head's q and k before the rotation (Qwen3)
    rope_scaling: tuple | None = None  # slm.model.rope's scaling tuple (Llama 3.x's llama3), None: plain RoPE
    # Gemma 3's block (all off elsewhere):
    norm_plus_one: bool = False  # every RMSNorm scales by (1 + w)
    sandwich_norms: bool = False  # a norm on the attention's and the MLP's outputs, before each residual add
    embed_scale: bool = False  # the embeddings times sqrt(d_model)
    mlp_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_scale: float | None = None  # the attention logits' scale (None: head_dim ** -0.5)
    layer_windows: tuple | None = None  # per layer, its sliding window (0: attends over the whole context)
    rope_local_theta: float | None = None  # the rope theta of sliding-window layers (None: rope_theta)
    o_bias: bool = False  # a bias on the attention's output projection (Llama/Qwen3's attention_bias: true)

    def __post_init__(self) -> None:  # config.json gives tuples back as lists
        for name in ("rope_scaling", "layer_windows"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope(self, layer: int) -> tuple[float, tuple | None]:
        """(theta, scaling) of layer `layer`'s rotary embedding: a sliding layer's local theta, unscaled."""
        if self.window(layer) and self.rope_local_theta is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


def count_params(shape: ModelShape) -> int:
    """Exact parameter count of model.Transformer for this shape (the module docstring's formula when the
    pretrained-family fields keep their defaults: then H*K == G*K == D)."""
    V, L, D, F = shape.vocab_size, shape.n_layers, shape.d_model, shape.d_ff
    qkv = (shape.n_heads + 2 * shape.kv_heads) * shape.head_dim
    attn = D * qkv + shape.n_heads * shape.head_dim * D + (qkv if shape.qkv_bias else 0) + (D if shape.o_bias else 0)
    norms = (4 if shape.sandwich_norms else 2) * D + (2 * shape.head_dim if shape.qk_norm else 0)
    return V * D * (1 if shape.tie_embeddings else 2) + L * (attn + 3 * D * F + norms) + D


def flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """Training FLOPs per token: 6N + 12*L*D*S (forward + backward, including attention); an untied
    embedding's lookup is free, so its V*D parameters are left out of N."""
    matmul_params = count_params(shape) - (0 if shape.tie_embeddings else shape.vocab_size * shape.d_model)
    return 6 * matmul_params + 12 * shape.n_layers * shape.n_heads * shape.head_dim * seq_len


def attention_block(length: int, blocks: int = 4, smallest: int = 64, largest: int = 512) -> int:
    """The query block of causal attention (slm.model.attention) for a sequence of `length`: a quarter of it,
    within 64..512 rows; `length` itself (one block) when that is no shorter. Measured on a 2-core Zen 3 EPYC
    (2026-11-26, bench/attention.py): at seq 256 blocks of 64 beat 128 and 256; at 1,024 and 2,048 blocks of
    256-512 beat 64-128 (smaller products run below the matmul's speed) and 1,024 (less is skipped). Each
    block is unrolled in every layer: compile time."""
    size = min(max(-(-length // blocks), smallest), largest)
    return length if size >= length else size


def visible_keys(seq_len: int) -> float:
    """The keys a query's block is computed against, on average: the memory and work of blocked causal
    attention per query (seq_len for one block; (n + 1) / 2n of it for n equal blocks)."""
    c = attention_block(seq_len)
    return sum(min(start + c, seq_len) * (min(start + c, seq_len) - start) for start in range(0, seq_len, c)) / seq_len


def default_head_dim(d_model: int) -> int:
    return 64 if d_model >= 512 and d_model % 64 == 0 else 32


def default_heads(d_model: int) -> int:
    """Heads of about `default_head_dim` each: the nearest count that divides d_model into an even head dim
    (d_model 112: 4 heads of 28). Widths on the grid of 32 get exactly d_model / default_head_dim."""
    base = max(1, d_model // default_head_dim(d_model))
    for step in range(d_model):  # outwards from base, the larger count first at each distance
        for h in (base + step, base - step):
            if 1 <= h <= d_model and d_model % h == 0 and (d_model // h) % 2 == 0:
                return h
    return base


def default_vocab_size(target_params: int) -> int:
    """Vocabulary for --vocab-size when none is given: 2048 from 0.5M to 10M parameters, then 4096 and 8192.

    A bigger vocabulary packs more bytes into each token, so a fixed time budget covers more text; at small
    sizes that outweighs the parameters the embedding takes from the blocks. Measured on tinyshakespeare at
    0.8M params, 97 s, 2 seeds (docs/performance.md, "Vocabulary and context"): 1024 -> 2048 lowered held-out
    bits/byte by 2.2-3.5% (the embedding grows from 16% to 33% of N; 3072 and 4096 were no better); on
    TinyStories at 1M, 10 minutes, by 2.0%.
    """
    for limit, vocab in ((500_000, 512), (10_000_000, 2048), (30_000_000, 4096)):
        if target_params < limit:
            return vocab
    return 8192


def default_learning_rate(n_params: int) -> float:
    """Peak AdamW learning rate for --learning-rate when none is given: 6e-4 * sqrt(125M / N), at most 1e-2.

    GPT-3's 125M model used 6e-4; smaller models tolerate (and need, on a short budget) much larger
    steps. Measured on tinyshakespeare at 0.8M params in 127 s: 1e-3 -> 2.57 bpb, 3e-3 -> 2.33, 6e-3 -> 2.27.
    """
    return min(1e-2, 6e-4 * (125e6 / n_params) ** 0.5)


def _solve_d_ff(target: int, vocab: int, L: int, D: int) -> int:
    rest = target - vocab * D - D - L * (4 * D * D + 2 * D)
    return round(rest / (3 * D * L) / 8.0) * 8


def choose_shape(
    target_params: int,
    vocab_size: int,
    n_layers: int | None = None,
    d_model: int | None = None,
    n_heads: int | None = None,
) -> ModelShape:
    """Choose (layers, width, heads, MLP width) whose exact count is within 5% of the target.

    Explicit `n_layers` / `d_model` / `n_heads` are honoured; the rest is solved for.
    Raises SizingError with a one-line reason when no shape fits.
    """
    if target_params <= 0:
        raise SizingError("--target-params must be positive")
    if vocab_size <= 0:
        raise SizingError("--vocab-size must be positive")
    if d_model is not None and n_heads is not None and d_model % n_heads:
        raise SizingError(f"--d-model {d_model} is not divisible by --n-heads {n_heads}")
    if d_model is not None and d_model % 2:
        raise SizingError(f"--d-model {d_model}: must be even (rotary positions rotate pairs)")
    if d_model is not None and n_heads is not None and (d_model // n_heads) % 2:
        raise SizingError(f"--d-model {d_model} / --n-heads {n_heads} gives an odd head dim; choose an even one")

    # Widths on a grid of 32 first (every shape chosen so far); when none fits within 5% (a pinned depth or
    # head count), a grid of 8 (4 layers at 0.8M parameters: d_model 112, between 96 and 128).
    best = _best_shape(target_params, vocab_size, [d_model] if d_model else list(range(32, 4097, 32)),
                       n_layers, d_model, n_heads)
    if best is None and d_model is None:
        best = _best_shape(target_params, vocab_size, list(range(32, 4097, 8)), n_layers, d_model, n_heads)
    if best is not None:
        return best
    min_params = vocab_size * 32 + 4 * 32 * 32 + 3 * 32 * 64 + 3 * 32  # one layer of width 32
    if (n_heads or d_model or n_layers) and target_params >= min_params:
        pinned = " / ".join(f"--{k} {v}" for k, v in (("n-layers", n_layers), ("d-model", d_model),
                                                      ("n-heads", n_heads)) if v)
        raise SizingError(
            f"no shape with {pinned} reaches --target-params {target_params:,} within 5% (d_ff between 2 and 4 "
            f"x d_model; head dim even and dividing d_model); adjust them or drop one"
        )
    raise SizingError(
        f"--target-params {target_params:,} is too small for vocab {vocab_size:,} "
        f"(the embedding alone needs {vocab_size * 32:,}+); use --target-params >= {min_params:,} "
        f"or a smaller --vocab-size"
    )


def _best_shape(target_params: int, vocab_size: int, widths: list[int], n_layers: int | None,
                d_model: int | None, n_heads: int | None) -> ModelShape | None:
    """The best-scoring shape over `widths` (and every depth unless pinned), or None when none fits."""
    depths = [n_layers] if n_layers else list(range(1, 65))
    best: tuple[float, ModelShape] | None = None
    for D in widths:
        if vocab_size * D >= target_params:
            break
        heads = n_heads or default_heads(D)
        for L in depths:
            F = _solve_d_ff(target_params, vocab_size, L, D)
            if not 2 * D <= F <= 4 * D:
                if d_model and n_layers:  # fully pinned shape: keep the closest legal F
                    F = min(max(F, 2 * D), 4 * D)
                else:
                    continue
            if D % heads or (D // heads) % 2:  # rotary needs an even head dim
                continue
            shape = ModelShape(vocab_size, L, D, heads, F)
            err = abs(count_params(shape) - target_params) / target_params
            if err > TOLERANCE and not (d_model and n_layers):
                continue
            score = abs(math.log(D / L / ASPECT)) + abs(math.log(F / (8 * D / 3))) + 10 * err
            if best is None or score < best[0]:
                best = (score, shape)
    return None if best is None else best[1]


def describe(shape: ModelShape, seq_len: int) -> str:
    n = count_params(shape)
    return (
        f"{n / 1e6:.3f}M params: {shape.n_layers} layers x d_model {shape.d_model} "
        f"({shape.n_heads} heads of {shape.head_dim}), d_ff {shape.d_ff}, vocab {shape.vocab_size}; "
        f"embedding {shape.vocab_size * shape.d_model / n:.0%} of params; "
        f"{flops_per_token(shape, seq_len) / 1e6:.1f} MFLOP/token"
    )


def param_shapes(shape: ModelShape) -> list[tuple[int, ...]]:
    """The shape of every parameter array of model.Transformer (order not significant); a pretrained
    family's grouped q/k/v, q/k/v bias and untied head included (their sizes sum to count_params)."""
    V, L, D, F = shape.vocab_size, shape.n_layers, shape.d_model, shape.d_ff
    q, qkv = shape.n_heads * shape.head_dim, (shape.n_heads + 2 * shape.kv_heads) * shape.head_dim
    per_block = [(D, qkv), (q, D), (D, 2 * F), (F, D), (D,), (D,)] + ([(qkv,)] if shape.qkv_bias else []) + (
        [(D,)] if shape.o_bias else [])
    return [(V, D)] * (1 if shape.tie_embeddings else 2) + per_block * L + [(D,)]


def hidden_matrix_shapes(shape: ModelShape) -> list[tuple[int, int]]:
    """The hidden matrices (attention q/k/v and output, MLP gate/up and down kernels): Muon's share."""
    D, F = shape.d_model, shape.d_ff
    q, qkv = shape.n_heads * shape.head_dim, (shape.n_heads + 2 * shape.kv_heads) * shape.head_dim
    return [(D, qkv), (q, D), (D, 2 * F), (F, D)] * shape.n_layers


def largest_matrix(shape: ModelShape) -> int:
    """Elements of the model's largest weight: the embedding (or head), or a fused qkv / gate-up kernel."""
    return max(shape.vocab_size * shape.d_model, *(a * b for a, b in hidden_matrix_shapes(shape)[:4]))


def muon_stacks(shape: ModelShape) -> dict[tuple[int, int], int]:
    """How many matrices of each (rows, columns) Muon orthogonalises as one stack (slm.optim.muon: fused
    kernels split into their matrices where they are alike, qkv (D, 3D) into three, gate_up into two)."""
    qkv, o, gate_up, down = hidden_matrix_shapes(shape)[:4]
    stacks: dict[tuple[int, int], int] = {}
    for (rows, cols), parts in ((qkv, 3 if qkv[1] == 3 * qkv[0] else 1), (o, 1), (gate_up, 2), (down, 1)):
        stacks[(rows, cols // parts)] = stacks.get((rows, cols // parts), 0) + parts * shape.n_layers
    return stacks


def optimizer_state_bytes(shape: ModelShape, use_8bit: bool = False, accumulation: int = 1,
                          min_8bit_size: int = 4096, block: int = 256, optimizer: str = "adamw") -> int:
    """Exact bytes of train_step.make_optimizer's state for this model (tests check it against nbytes).

    float32 AdamW: m and v, 4 + 4 bytes per parameter. 8-bit (adam8bit.py): for each array of at least
    `min_8bit_size` elements, 1 + 1 byte of codes per element and 4 + 4 bytes per `block` elements (the
    scales; a partial last block counts whole), i.e. 2.03 bytes/param; smaller arrays stay float32.
    Plus the parameter-sized float32 accumulator of optax.MultiSteps when accumulation > 1, and a few
    scalars (step counts, the non-finite guard's flags). With `optimizer="muon"` the hidden matrices hold
    one momentum (4 bytes/param, 2 with `use_8bit`) instead of Adam's two.
    """
    if optimizer != "muon":
        return adam_state_bytes(param_shapes(shape), use_8bit, accumulation, min_8bit_size, block)
    # Muon (slm.optim.muon): one momentum per hidden matrix, float32 or (with 8-bit) bfloat16, and three
    # counts and its 3 Newton-Schulz coefficients; AdamW's state for the other arrays.
    hidden = hidden_matrix_shapes(shape)
    rest = list(param_shapes(shape))
    for s in hidden:
        rest.remove(s)
    n_hidden = sum(math.prod(s) for s in hidden)
    total = adam_state_bytes(rest, use_8bit, 1, min_8bit_size, block) + (2 if use_8bit else 4) * n_hidden + 4 * 3 + 4 * 2
    if accumulation > 1:
        total += 4 * count_params(shape) + 4 + 4
    return total


def adam_state_bytes(shapes: list[tuple[int, ...]], use_8bit: bool = False, accumulation: int = 1,
                     min_8bit_size: int = 4096, block: int = 256) -> int:
    """optimizer_state_bytes for any list of trained arrays (a whole model's, or LoRA's adapters)."""
    total = 0
    for s in shapes:
        n = math.prod(s)
        total += 2 * n + 8 * -(-n // block) if use_8bit and n >= min_8bit_size else 8 * n
    scalars = 4 + 1 + 4 + (4 + 4 if use_8bit else 4)  # apply_if_finite: 2 int32 + bool; Adam count (+ skipped)
    if accumulation > 1:  # MultiSteps: acc_grads, mini_step, gradient_step, skip state
        total += 4 * sum(math.prod(s) for s in shapes) + 4 + 4
    return total + scalars


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_param_shapes(shape: ModelShape, rank: int,
                      targets: tuple[str, ...] | list[str] = ("q_proj", "v_proj")) -> list[tuple[int, int]]:
    """The adapters' arrays, A (in, rank) and B (rank, out) per targeted projection per layer (float32)."""
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown:
        raise SizingError(f"--lora-targets {','.join(unknown)}: not a projection of this model; choose from "
                          f"{','.join(LORA_TARGETS)}")
    D, F, q, kv = shape.d_model, shape.d_ff, shape.n_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    dims = {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D), "gate_proj": (D, F),
            "up_proj": (D, F), "down_proj": (F, D)}
    per_layer = [s for t in sorted(set(targets)) for s in ((dims[t][0], rank), (rank, dims[t][1]))]
    return per_layer * shape.n_layers


def lora_params(shape: ModelShape, rank: int, targets: tuple[str, ...] | list[str] = ("q_proj", "v_proj")) -> int:
    """Trainable parameters of rank-`rank` LoRA adapters on the named projections (Hugging Face module
    names) of every layer: r * (in + out) per adapted matrix, as PEFT counts them."""
    return sum(math.prod(s) for s in lora_param_shapes(shape, rank, targets))


def default_loss_chunk(vocab_size: int, platform: str = "cpu", matmul: str = "float32") -> int:
    """--loss-chunk's default (slm.model.loss), from train steps on a 2-core AVX512-BF16 CPU (docs/performance.md):
    with bf16 products, chunks of 512 ran 1.0-1.5x faster than the whole logits at vocabularies 2,048-8,192; with
    float32 products 0.94-0.98x there but 1.37x at 32,000, so float32 keeps the whole logits up to 8,192. An
    accelerator (not measured) takes chunks of 8,192 above that: a loop of fewer, larger products, still a
    fraction of a big vocabulary's logits (Qwen2.5's 151,936)."""
    if platform != "cpu":
        return 8192 if vocab_size > 8192 else 0
    if matmul == "bfloat16":
        return 512 if vocab_size > 512 else 0
    return 512 if vocab_size > 8192 else 0


def default_optimizer(lora: bool, pretrained: bool) -> str:
    """--optimizer's default: Muon (its hidden-matrix rate, --muon-learning-rate) for a model trained from scratch;
    AdamW for LoRA (adapters are low-rank by design) and for a pretrained start, where --learning-rate must be
    the rate every trained parameter gets: Muon's 0.02 on the hidden matrices whatever --learning-rate says
    damaged a pretrained model (issue 41: held-out loss 2.947 -> 2.992 in 30 steps at --learning-rate 5e-5)."""
    return "adamw" if lora or pretrained else "muon"


def default_dropout(pretrained: bool) -> float:
    """--dropout's default: 0.1 for a model trained from scratch, from --dropout-from-epoch's default 1, i.e. only
    once the data repeats (measured at the race's budget, where tinyshakespeare repeats ~9 times:
    docs/performance.md); 0 for a pretrained model (--init-from), whose weights were trained without it."""
    return 0.0 if pretrained else 0.1


def logit_columns(vocab_size: int, loss_chunk: int | None, platform: str = "cpu") -> int:
    """The logits' columns a step holds at once: the chunk, or the whole vocabulary (0 or >= V). None: the
    default with float32 products, the larger where the default differs (an estimate errs high)."""
    chunk = default_loss_chunk(vocab_size, platform) if loss_chunk is None else loss_chunk
    return min(chunk, vocab_size) if chunk > 0 else vocab_size
