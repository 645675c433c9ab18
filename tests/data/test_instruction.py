"""Instruction data (--prompt-column/--response-column, --chat-template): targets are -1 exactly where the target
token is not a response token and the next token elsewhere, plain or with a chat template rendered as
transformers renders it; exact resume, the full-load path, the eval set, and the one-line errors."""

import hashlib
import json

import numpy as np
import pytest
import tokenizer_zoo as zoo
from tokenizer_zoo import CHATML, QWEN2_TEMPLATE

from slm.data.heldout import build_eval_set, held_out_split
from slm.data.instruction import Example, load_chat_template, render_parts
from slm.data.packing import prepare_sequences
from slm.data.sources import HubDataset, ListSource, resolve_source
from slm.data.stream import StreamingDataLoader
from slm.data.tokenizer import (
    load_tokenizer,
    special_ids,
    token_byte_lengths,
    train_bpe,
)
from slm.errors import DatasetError, TokenizerError

# Qwen2-Instruct's template (tokenizer_config.json of Qwen/Qwen2-0.5B-Instruct) and Llama-3-Instruct's.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# (template, special tokens, tokenizer_config, the prompt part and the response part written out by hand)
TEMPLATES = {
    "qwen2": (QWEN2_TEMPLATE, CHATML, {"eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>"},
              lambda p: f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{p}<|im_end|>\n"
                        f"<|im_start|>assistant\n",
              lambda r: f"{r}<|im_end|>\n"),
    "llama3": (LLAMA3_TEMPLATE, LLAMA3, {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"},
               lambda p: f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{p.strip()}<|eot_id|>"
                         f"<|start_header_id|>assistant<|end_header_id|>\n\n",
               lambda r: f"{r.strip()}<|eot_id|>"),
}
EXAMPLES = [(f"Story {i}: where did the little dog run?\n",
             f"It ran to the park and saw a red ball.{' It was happy.' * (i % 4)} {i * 7} times.") for i in range(48)]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


@pytest.fixture()
def data(tmp_path) -> str:
    return write_jsonl(tmp_path / "sft.jsonl", [{"id": i, "prompt": p, "response": r} for i, (p, r) in enumerate(EXAMPLES)])


def loader(path, tok, **kw) -> StreamingDataLoader:
    kw = {"seq_len": 24, "batch_size": 4, "shuffle_buffer_size": 0, "prefetch": 0, **kw}
    return StreamingDataLoader(path, tok, prompt_column="prompt", response_column="response", **kw)


def flat(batches) -> tuple[np.ndarray, np.ndarray]:
    """All rows end to end: with stride == seq_len they are the packed stream's inputs and its targets."""
    assert all(b["input_ids"].dtype == np.int32 == b["targets"].dtype for b in batches)
    return (np.concatenate([b["input_ids"].reshape(-1) for b in batches]),
            np.concatenate([b["targets"].reshape(-1) for b in batches]))


def reference(tok, parts) -> tuple[np.ndarray, np.ndarray]:
    """The packed stream built without the loader: (ids, whether each is a response token) of
    [(text or ids not trained on, text or ids trained on), ...]."""
    ids, scored = [], []
    for masked, trained in parts:
        for piece, flag in ((masked, False), (trained, True)):
            piece = tok.encode(piece, add_special_tokens=False).ids if isinstance(piece, str) else piece
            ids += piece
            scored += [flag] * len(piece)
    return np.array(ids), np.array(scored)


def check_targets(inputs, targets, ids, scored) -> None:
    n = len(inputs)
    np.testing.assert_array_equal(inputs, ids[:n])
    np.testing.assert_array_equal(targets, np.where(scored[1:n + 1], ids[1:n + 1], -1))


def runs(targets) -> list[np.ndarray]:
    """The maximal runs of scored targets (one per example)."""
    edges = np.flatnonzero(np.diff(np.r_[False, targets >= 0, False].astype(int)))
    return [targets[a:b] for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("kind", ["byte_level", "llama"])
def test_targets_are_the_response_tokens_and_its_eos_only(data, kind):
    """No template: [bos] prompt response eos, each part tokenized on its own; bos and prompt not scored."""
    tok = zoo.byte_level(["<|endoftext|>"]) if kind == "byte_level" else zoo.llama_style()
    special = special_ids(tok)
    assert (special.lead, special.tail) == (([], [tok.token_to_id("<|endoftext|>")]) if kind == "byte_level" else
                                            ([tok.token_to_id("<s>")], [tok.token_to_id("</s>")]))
    inputs, targets = flat(list(loader(data, tok)))
    ids, scored = reference(tok, [(special.lead + tok.encode(p, add_special_tokens=False).ids,
                                   tok.encode(r, add_special_tokens=False).ids + special.tail) for p, r in EXAMPLES])
    check_targets(inputs, targets, ids, scored)
    done = runs(targets)[:-1]  # the last may be cut by the end of the stream
    assert len(done) >= 20
    for run, (_, response) in zip(done, EXAMPLES):
        assert run[-1] == special.eos and tok.decode(run[:-1].tolist()) == response


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_template_scores_the_assistant_turn_only(data, tmp_path, name):
    template, specials, config, prompt_part, response_part = TEMPLATES[name]
    path = zoo.save_folder(zoo.byte_level(specials), tmp_path / name, {**config, "chat_template": template})
    assert load_chat_template(path) == template
    tok = load_tokenizer(path)
    inputs, targets = flat(list(loader(data, path, chat_template=template)))
    # The template holds bos and eos itself: none added (Llama-3: one <|begin_of_text|> per example).
    ids, scored = reference(tok, [(prompt_part(p), response_part(r)) for p, r in EXAMPLES])
    check_targets(inputs, targets, ids, scored)
    done = runs(targets)[:-1]
    assert len(done) >= 10
    for run, (_, response) in zip(done, EXAMPLES):
        assert tok.decode(run.tolist(), skip_special_tokens=False) == response_part(response)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_rendering_equals_transformers_apply_chat_template(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    template, specials, config, _, _ = TEMPLATES[name]
    path = zoo.save_folder(zoo.byte_level(specials), tmp_path / name, {**config, "chat_template": template})
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path / name))
    prompt, response = EXAMPLES[5]
    user, assistant = {"role": "user", "content": prompt}, {"role": "assistant", "content": response}
    head, rest = render_parts(load_chat_template(path), Example(prompt, response), hf.bos_token, hf.eos_token)
    assert head == hf.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    assert head + rest == hf.apply_chat_template([user, assistant], tokenize=False)


def digest(batch) -> str:
    return hashlib.sha256(batch["input_ids"].tobytes() + batch["targets"].tobytes()).hexdigest()


def test_resume_mid_epoch_gives_the_same_batches(data, tmp_path):
    """Examples sit in the shuffle buffer of the saved state (as JSON lists, as a checkpoint stores them)."""
    template, specials, config, _, _ = TEMPLATES["qwen2"]
    path = zoo.save_folder(zoo.byte_level(specials), tmp_path / "qwen2", {**config, "chat_template": template})

    def make():
        return loader(data, path, chat_template=template, shuffle_buffer_size=8, seed=3, prefetch=2, batch_size=2,
                      chunk_chars=500)

    first = make()
    digests, states = [], []
    for batch in first.iter_epoch(1):
        digests.append(digest(batch))
        states.append(json.loads(json.dumps(first.state_json())))
    assert len(digests) >= 12 and any(isinstance(d, list) for s in states for d in s["buffer"])
    for k in (0, 3, len(states) // 2, len(states) - 2):
        assert [digest(b) for b in make().iter_epoch(1, states[k])] == digests[k + 1:], f"resumed after batch {k}"


def test_full_load_path_and_eval_set_mask_the_same_tokens(data):
    tok = zoo.byte_level(["<|endoftext|>"])
    special = special_ids(tok)
    batches = list(loader(data, tok))
    source = resolve_source(data, prompt_column="prompt", response_column="response")
    inputs, targets = prepare_sequences(source, tok, 24, special=special)
    n = sum(len(b["input_ids"]) for b in batches)
    np.testing.assert_array_equal(inputs[:n], np.concatenate([b["input_ids"] for b in batches]))
    np.testing.assert_array_equal(targets[:n], np.concatenate([b["targets"] for b in batches]))

    docs, rest = held_out_split(source, 500)  # the held-out head counts an example's characters
    assert rest and all(isinstance(d, Example) for d in docs) and 500 <= sum(len(p + r) for p, r in docs) < 800
    es = build_eval_set(docs, tok, 24, None, "held-out", special)
    ids, scored = reference(tok, [(p, tok.encode(r, add_special_tokens=False).ids + special.tail) for p, r in docs])
    ids, scored = np.r_[special.eos, ids], np.r_[False, scored]  # the eos a document follows in training
    n = len(ids) - 1  # targets; the rest of the last row is padding
    np.testing.assert_array_equal(es.targets.reshape(-1)[:n], np.where(scored[1:], ids[1:], -1))
    np.testing.assert_array_equal(es.mask.reshape(-1), np.r_[scored[1:], np.zeros(es.mask.size - n, bool)])
    assert es.n_bytes == token_byte_lengths(tok)[ids[scored]].sum()


def test_a_tokenizer_trains_on_examples_and_text_sources_keep_working(data):
    examples = list(resolve_source(data, prompt_column="prompt", response_column="response").documents())
    assert examples[0] == Example(*EXAMPLES[0]) and len(examples) == len(EXAMPLES)
    tok = train_bpe(examples, vocab_size=300)
    assert tok.decode(tok.encode(EXAMPLES[3][1]).ids) == EXAMPLES[3][1]
    # A source of your own yields Examples itself; a plain text among them is trained on whole.
    mixed = ListSource("mine", [Example("Q: a dog?\n", "A red ball."), "The little dog ran to the park."] * 30)
    targets = np.concatenate([b["targets"] for b in StreamingDataLoader(mixed, tok, seq_len=16, batch_size=2,
                                                                        shuffle_buffer_size=0, prefetch=0)])
    assert (targets == -1).any() and (targets >= 0).mean() > 0.5


@pytest.mark.parametrize("ext", [".jsonl", ".csv", ".parquet"])
def test_a_missing_column_is_one_line_naming_it_and_the_columns(tmp_path, ext):
    rows = [{"question": f"Q{i}?", "answer": f"A{i}."} for i in range(5)]
    path = tmp_path / f"sft{ext}"
    if ext == ".jsonl":
        write_jsonl(path, rows)
    elif ext == ".csv":
        path.write_text("question,answer\n" + "".join(f"{r['question']},{r['answer']}\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), str(path))
    read = lambda p, r: list(resolve_source(str(path), prompt_column=p, response_column=r).documents())
    assert read("question", "answer")[2] == Example("Q2?", "A2.")
    for flag, cols in (("--prompt-column prompt", ("prompt", "answer")), ("--response-column response", ("question", "response"))):
        with pytest.raises(DatasetError) as e:
            read(*cols)
        assert "\n" not in str(e.value) and str(e.value).startswith(flag) and "['question', 'answer']" in str(e.value)


@pytest.mark.parametrize("streaming", [True, False])
def test_hub_datasets_yield_examples_and_name_a_missing_column(tmp_path, monkeypatch, streaming):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "hub").mkdir()
    write_jsonl(tmp_path / "hub" / "train.jsonl", [{"q": p, "a": r} for p, r in EXAMPLES])
    write_jsonl(tmp_path / "hub" / "validation.jsonl", [{"q": "Held out?", "a": "Yes."}])
    src = HubDataset(str(tmp_path / "hub"), streaming=streaming, prompt_column="q", response_column="a")
    assert list(src.documents()) == [Example(p, r) for p, r in EXAMPLES]
    assert list(src.validation().documents()) == [Example("Held out?", "Yes.")]
    with pytest.raises(DatasetError, match=r"^--prompt-column prompt: .* columns are \['q', 'a'\]$"):
        list(HubDataset(str(tmp_path / "hub"), streaming=streaming, prompt_column="prompt", response_column="a").documents())


def test_settings_that_cannot_work_are_one_line(data, tmp_path):
    tok = zoo.byte_level(["<|endoftext|>"])
    errors = []
    (tmp_path / "a.txt").write_text("some text\n")
    for call in (lambda: StreamingDataLoader(data, tok, prompt_column="prompt"),
                 lambda: StreamingDataLoader(data, tok, chat_template=QWEN2_TEMPLATE),
                 lambda: loader(data, tok, chat_template="{% for m in messages %}"),  # does not compile
                 lambda: next(iter(loader(data, tok, chat_template="{{ raise_exception('no user turns') }}"))),
                 lambda: list(resolve_source(str(tmp_path / "a.txt"), prompt_column="p", response_column="r").documents())):
        with pytest.raises((DatasetError, TokenizerError)) as e:
            call()
        errors.append(str(e.value))
    assert all("\n" not in m for m in errors), errors
    assert "give both" in errors[0] and "--chat-template: needs --prompt-column" in errors[1]
    assert "does not compile" in errors[2] and "no user turns" in errors[3] and "a.txt is a text file" in errors[4]


def test_a_missing_chat_template_is_one_line_naming_the_file(tmp_path):
    path = zoo.save_folder(zoo.byte_level(CHATML), tmp_path / "base", {"eos_token": "<|endoftext|>"})
    with pytest.raises(TokenizerError) as e:
        load_chat_template(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith("--chat-template") and str(tmp_path / "base" / "tokenizer_config.json") in message
    (tmp_path / "base" / "tokenizer_config.json").unlink()  # no config at all: the same line
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_chat_template(path)
    with pytest.raises(TokenizerError, match="--chat-template: needs a tokenizer folder"):
        load_chat_template(None)
    # Newer transformers save the template beside the config, as chat_template.jinja.
    (tmp_path / "base" / "chat_template.jinja").write_text(QWEN2_TEMPLATE)
    assert load_chat_template(str(tmp_path / "base")) == QWEN2_TEMPLATE
