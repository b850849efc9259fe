"""Data formats: detection from the columns, loss masks against transformers' generation markers, fitting long
conversations, folder sources and a separate eval file."""

import json
from pathlib import Path

import pytest

from ddp_ft.training.data import IGNORE_INDEX, DataSettings, load_raw_splits, tokenize_dataset
from ddp_ft.training.data.conversation import encode_messages, fit_completion, fit_conversation, text_windows
from ddp_ft.training.data.formats import resolve_format
from ddp_ft.training.data.prompts import chat_prompt, prompt_of
from ddp_ft.training.data.tokenizer import build_tiny_tokenizer, ensure_chat_format, load_tokenizer

from ..helpers.data import QWEN2_TOKENIZER

# ChatML with {% generation %} markers: transformers' assistant mask is the reference for ours.
CHATML_MARKED = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# As Qwen3's: the last answer opens with an empty reasoning block that earlier answers lose.
THINK = "'<think>\\n\\n</think>\\n\\n'"
HISTORY = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last %}{{- " + THINK + " }}{%- endif %}{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
HISTORY_MARKED = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{%- generation %}"
    "{%- if loop.last %}{{- " + THINK + " }}{%- endif %}{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)
# As Qwen2.5's: a default system prompt where the conversation has none.
DEFAULT_SYSTEM = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nBe helpful.<|im_end|>\\n' }}{%- endif %}"
)
PLAIN_MARKED = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{- '\\n\\n### Response:\\n' }}"
    "{%- generation %}{{- message['content'] + eos_token }}{%- endgeneration %}"
    "{%- else %}{%- if not loop.first %}{{- '\\n\\n' }}{%- endif %}{{- message['content'] }}{%- endif %}"
    "{%- endfor %}"
)

CHAT = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What did the team decide about the remote?"},
    {"role": "assistant", "content": "A curved case in yellow, with a scroll wheel."},
    {"role": "user", "content": "And the budget?"},
    {"role": "assistant", "content": "Twelve euros fifty per unit, as marketing asked."},
    {"role": "user", "content": "Who presents next time?"},
    {"role": "assistant", "content": "The industrial designer presents the prototype."},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tokenizer(str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")))
    tokenizer.chat_template = None
    return ensure_chat_format(tokenizer, "plain")


def reference(tokenizer, template: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def mask(labels: list[int]) -> list[int]:
    return [int(label != IGNORE_INDEX) for label in labels]


@pytest.mark.parametrize("turns", [3, 5, 7, 2])
@pytest.mark.parametrize("case", ["chatml", "history", "plain", "qwen2"])
def test_loss_masks_equal_the_generation_markers(case, turns, tiny, plain):
    messages = CHAT[:turns] if turns > 2 else CHAT[1:3]
    tokenizer, marked = {"chatml": (tiny, CHATML_MARKED), "plain": (plain, PLAIN_MARKED)}.get(case, (tiny, None))
    if case == "history":
        tokenizer, marked = ensure_chat_format(load_tokenizer(tiny.name_or_path), "auto"), HISTORY_MARKED
        tokenizer.chat_template = HISTORY
    if case == "qwen2":
        if not QWEN2_TOKENIZER.is_dir():
            pytest.skip("shared test data (qwen2-tokenizer) not present")
        tokenizer, marked = load_tokenizer(str(QWEN2_TOKENIZER)), CHATML_MARKED
    ids, labels = encode_messages(tokenizer, messages)
    ref_ids, ref_mask = reference(tokenizer, marked, messages)
    assert ids == ref_ids
    assert mask(labels) == ref_mask
    assert sum(ref_mask) > 0 and [i for i, m in zip(ids, labels, strict=True) if m != IGNORE_INDEX] == [
        i for i, m in zip(ids, ref_mask, strict=True) if m
    ]


def test_default_system_and_first_answer_not_trained(tiny):
    tokenizer = ensure_chat_format(load_tokenizer(tiny.name_or_path), "auto")
    tokenizer.chat_template = DEFAULT_SYSTEM + tokenizer.chat_template
    for messages in (CHAT[1:5], [{"role": "assistant", "content": "Hello, shall we start?"}, *CHAT[1:3]]):
        ids, labels = encode_messages(tokenizer, messages)
        assert (ids, mask(labels)) == reference(tokenizer, DEFAULT_SYSTEM + CHATML_MARKED, messages)


def test_an_empty_answer_carries_no_loss(tiny):
    messages = [CHAT[1], {"role": "assistant", "content": ""}, *CHAT[3:5]]
    ids, labels = encode_messages(tiny, messages)
    trained = tiny.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert trained == "Twelve euros fifty per unit, as marketing asked.<|im_end|>\n"


def test_prompt_completion_trains_the_completion_only(tiny):
    ids, labels = encode_messages(tiny, CHAT[:5], loss_from=3)
    _, every_answer = encode_messages(tiny, CHAT[:5])
    trained = tiny.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert trained == "Twelve euros fifty per unit, as marketing asked.<|im_end|>\n"
    assert sum(mask(labels)) < sum(mask(every_answer))


def test_long_chat_keeps_system_prompt_and_last_turns(tiny):
    full, _ = encode_messages(tiny, CHAT)
    last_two, _ = encode_messages(tiny, [CHAT[0], *CHAT[3:]])
    fitted = fit_conversation(tiny, CHAT, 0, len(last_two))
    assert (fitted.full_len, fitted.turns_cut, fitted.answer_cut) == (len(full), 2, False)
    assert fitted.input_ids == last_two
    assert tiny.decode(fitted.input_ids).startswith("<|im_start|>system\nYou answer in one sentence.")


def test_chat_whose_last_answer_cannot_start_dropped(tiny):
    system_and_question, _ = encode_messages(tiny, CHAT[:2] + [{"role": "assistant", "content": "x"}])
    fitted = fit_conversation(tiny, CHAT[:3], 0, len(system_and_question) - 3)
    assert fitted.input_ids == [] and fitted.full_len > 0
    cut = fit_conversation(tiny, CHAT[:3], 0, len(system_and_question) + 1)
    assert cut.answer_cut and len(cut.input_ids) == len(system_and_question) + 1 and sum(mask(cut.labels)) >= 1


def test_plain_completion_is_encoded_as_trl_encodes_it(tiny):
    fitted = fit_completion(tiny, "The remote is", " yellow.", 64)
    whole = tiny("The remote is yellow." + tiny.eos_token)["input_ids"]
    prompt = tiny("The remote is")["input_ids"]
    assert fitted.input_ids == whole
    assert fitted.labels == [IGNORE_INDEX] * len(prompt) + whole[len(prompt) :]


def test_a_long_text_becomes_windows_of_every_token(tiny):
    text = " ".join(f"meeting {i} decided the budget." for i in range(40))
    ids = tiny(text + tiny.eos_token)["input_ids"]
    windows = text_windows(tiny, text, 64)
    assert sum(windows, []) == ids[: sum(len(w) for w in windows)] and all(len(w) <= 64 for w in windows)
    assert len(windows) == -(-len(ids) // 64) - (len(ids) % 64 == 1)


# ---------------------------------------------------------------------------------------------------------------
# Detection and standard rows, from files as people keep them

ROWS = {
    "messages": {"messages": CHAT},
    "sharegpt": {
        "conversations": [{"from": "system", "value": CHAT[0]["content"]}]
        + [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in CHAT[1:]]
    },
    "alpaca": {"instruction": "Summarize the decision.", "input": "We chose yellow.", "output": "Yellow."},
    "prompt_completion": {"prompt": CHAT[:2], "completion": [CHAT[2]]},
    "plain_completion": {"prompt": "The remote is", "completion": " yellow."},
    "text": {"text": "The team met to design a remote control. " * 3},
    "pair": {"dialogue": "A: yellow? B: yes.", "summary": "They chose yellow."},
}


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("name", list(ROWS))
def test_every_format_is_detected_and_trains_answers(name, tmp_path, tiny):
    source = write(tmp_path / f"{name}.jsonl", [ROWS[name]] * 8)
    settings = DataSettings(source=str(source), eval_fraction=0.25, max_seq_len=256)
    splits = load_raw_splits(settings, cache_dir=str(tmp_path / "cache"))
    samples, report = tokenize_dataset(splits["train"], tiny, settings)
    assert (len(samples), report.dropped) == (6, 0)
    ids, labels = samples[0]["input_ids"], samples[0]["labels"]
    trained = tiny.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    expected = {
        "messages": "Twelve euros fifty",
        "sharegpt": "industrial designer presents",
        "alpaca": "Yellow.<|im_end|>",
        "prompt_completion": "A curved case",
        "plain_completion": " yellow.<|im_end|>",
        "text": "The team met",
        "pair": "They chose yellow.",
    }
    assert expected[name] in trained
    if name in ("messages", "sharegpt"):
        assert "What did the team decide" not in trained and "A curved case" in trained
    if name == "prompt_completion":
        assert "What did the team decide" not in trained and "Twelve" not in trained


def test_named_format_overrides_and_lists_missing():
    settings = DataSettings(format="text")
    assert resolve_format(dict.fromkeys(["messages", "text"]), settings, "here").name == "text"
    assert resolve_format(dict.fromkeys(["messages", "text"]), DataSettings(), "here").name == "messages"
    with pytest.raises(ValueError, match=r"--format alpaca needs column\(s\) \['output'\].*Columns found"):
        resolve_format(dict.fromkeys(["instruction"]), DataSettings(format="alpaca"), "here")
    with pytest.raises(ValueError, match=r"no known data format.*\['question', 'answer'\].*sharegpt \(conversations\)"):
        resolve_format(dict.fromkeys(["question", "answer"]), DataSettings(), "here")


def test_pair_settings_on_other_format_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--instruction set for data in the messages format.*--format pair"):
        DataSettings(format="messages", instruction="Answer.")
    source = write(tmp_path / "chat.jsonl", [ROWS["messages"]] * 4)
    with pytest.raises(ValueError, match=r"--instruction set for data in the messages format"):
        load_raw_splits(DataSettings(source=str(source), instruction="Answer."), cache_dir=str(tmp_path / "c"))


def test_bad_roles_or_content_refused_naming_the_turn(tmp_path):
    bad = {"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "beep"}]}
    source = write(tmp_path / "bad.jsonl", [bad] * 3)
    with pytest.raises(ValueError, match=r"'conversations': turn role 'robot' is not one of"):
        load_raw_splits(DataSettings(source=str(source)), cache_dir=str(tmp_path / "c"))


def test_long_chats_fitted_and_empty_answers_dropped(tmp_path, tiny):
    rows = [{"messages": CHAT}] * 6 + [{"messages": [*CHAT[:2], {"role": "assistant", "content": " "}]}] * 2
    source = write(tmp_path / "chat.jsonl", rows)
    settings = DataSettings(source=str(source), eval_fraction=0.0, max_seq_len=64)
    splits = load_raw_splits(settings, cache_dir=str(tmp_path / "c"))
    assert len(splits["train"]) == 6  # the empty answers left before tokenizing
    samples, report = tokenize_dataset(splits["train"], tiny, settings)
    assert (report.samples, report.turns_cut, report.dropped) == (6, 6, 0)
    assert all(len(ids) <= 64 for ids in samples["input_ids"]) and "lost their first turns" in report.advice()


# ---------------------------------------------------------------------------------------------------------------
# Folder sources and a separate eval file


def test_folder_names_files_per_split_reads_each_once(tmp_path, caplog):
    folder = tmp_path / "data"
    (folder / "more").mkdir(parents=True)
    write(folder / "train.jsonl", [ROWS["messages"]] * 5)
    write(folder / "more" / "train_extra.jsonl", [{"messages": CHAT[:3]}] * 3)
    write(folder / "validation.jsonl", [{"messages": CHAT[:5]}] * 2)
    with caplog.at_level("INFO"):
        splits = load_raw_splits(DataSettings(source=str(folder)), cache_dir=str(tmp_path / "c"))
    assert (len(splits["train"]), len(splits["eval"])) == (8, 2)
    assert "train: more/train_extra.jsonl, train.jsonl; validation: validation.jsonl" in caplog.text


@pytest.mark.parametrize(
    ("files", "error"),
    [
        ({"a.jsonl": "messages", "sub/a_copy.jsonl": "messages"}, r"a.jsonl, sub/a_copy.jsonl hold the same data"),
        ({"train.jsonl": "messages", "train.csv": None}, r"files of several types"),
        ({"train.jsonl": "messages", "notes.jsonl": "text"}, r"notes.jsonl belong to no split"),
        ({"train.jsonl": "messages", "validation.jsonl": "alpaca"}, r"several formats \(messages: train.jsonl; alpaca"),
    ],
)
def test_folder_duplicates_or_mixed_files_are_refused(files, error, tmp_path):
    folder = tmp_path / "data"
    for name, fmt in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        if fmt is None:
            (folder / name).write_text("dialogue,summary\na,b\n")
        else:
            write(folder / name, [ROWS[fmt]] * 3)
    with pytest.raises(ValueError, match=error):
        load_raw_splits(DataSettings(source=str(folder)), cache_dir=str(tmp_path / "c"))


def test_eval_source_used_and_path_eval_split_refused(tmp_path):
    train = write(tmp_path / "qa_train.jsonl", [ROWS["alpaca"]] * 6)
    valid = write(tmp_path / "qa_validation.jsonl", [{**ROWS["alpaca"], "output": "Blue."}] * 2)
    splits = load_raw_splits(DataSettings(source=str(train), eval_source=str(valid)), cache_dir=str(tmp_path / "c"))
    assert (len(splits["train"]), len(splits["eval"])) == (6, 2)
    assert splits["eval"][0]["messages"][-1]["content"] == "Blue."
    with pytest.raises(ValueError, match=r"eval_split='data/qa_validation.jsonl' looks like a path.*--eval-source"):
        DataSettings(source=str(train), eval_split="data/qa_validation.jsonl")
    with pytest.raises(FileNotFoundError, match=r"eval_source=.*no such file.*--eval-source"):
        load_raw_splits(DataSettings(source=str(train), eval_source=str(tmp_path / "nope.jsonl")))


# ---------------------------------------------------------------------------------------------------------------
# Generation prompts: the training tokens before the last answer


@pytest.mark.parametrize("name", list(ROWS))
def test_generation_prompt_is_sample_before_answer(name, tmp_path, tiny):
    source = write(tmp_path / f"{name}.jsonl", [ROWS[name]] * 4)
    settings = DataSettings(source=str(source), eval_fraction=0.0, max_seq_len=256)
    rows = load_raw_splits(settings, cache_dir=str(tmp_path / "cache"))["train"]
    samples, _ = tokenize_dataset(rows, tiny, settings)
    ids, labels = samples[0]["input_ids"], samples[0]["labels"]
    prompt = prompt_of(rows[0], tiny, settings)
    if name == "text":
        assert ids[: len(prompt.input_ids)] == prompt.input_ids and prompt.reference is None
        return
    last_answer = max(i for i, label in enumerate(labels) if label == IGNORE_INDEX) + 1
    assert prompt.input_ids == ids[:last_answer]
    assert prompt.reference and prompt.reference.strip() in tiny.decode(ids[last_answer:])


def test_prompt_alone_is_written_as_training_prompt(tiny):
    history = CHAT[:4]  # ends on a question
    asked = chat_prompt(history, tiny)
    trained = chat_prompt([*history, CHAT[4]], tiny)
    assert asked.input_ids == trained.input_ids and asked.reference is None
    assert asked.text.endswith("<|im_start|>assistant\n")


def test_trl_recipe_trains_chat_rows_with_masks(tmp_path, tiny, monkeypatch, tiny_cache):
    """``ddp-ft recipe --trainer trl`` on a messages file: TRL gets the rows as ddp_ft encoded them, answers only."""
    from ddp_ft.distributed import DistInfo
    from ddp_ft.integrations.recipe import build_trainer
    from ddp_ft.training.config import settings_from_preset

    monkeypatch.setenv("DDP_FT_CACHE", str(tiny_cache))
    source = write(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 8)
    settings = settings_from_preset(
        "tiny", source=str(source), output_dir=str(tmp_path / "run"), report_to="none", effective_batch=2
    )
    trainer = build_trainer(settings, DistInfo(), "trl")
    row = trainer.train_dataset[0]
    ids, labels = encode_messages(trainer.processing_class, CHAT)
    assert (list(row["input_ids"]), list(row["labels"])) == (ids, labels)
