"""Data pipeline: pure truncation, synthetic meetings, sources and their errors, real AMI through real tokenizers,
collation, and the per-rank epoch loader."""

import csv
import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest

from ddp_ft.training.data import (
    IGNORE_INDEX,
    MIN_MAX_SEQ_LEN,
    DataLayout,
    DataSettings,
    EpochLoader,
    TruncationReport,
    check_resume,
    count_tokens,
    load_raw_splits,
    make_collator,
    template_overhead,
    tokenize_dataset,
    truncate_example,
)
from ddp_ft.training.data.formatting import _id_lists
from ddp_ft.training.data.synthetic import generate_synthetic_meetings
from ddp_ft.training.data.tokenizer import build_tiny_tokenizer, load_tokenizer

from ..helpers.data import AMI, QWEN2_TOKENIZER

needs_shared_data = pytest.mark.skipif(
    not (AMI.is_file() and QWEN2_TOKENIZER.is_dir()), reason="shared test data (AMI, qwen2-tokenizer) not present"
)


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf-datasets-cache"))


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    return load_tokenizer(str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")))


@pytest.fixture(scope="module")
def qwen_tokenizer():
    if not QWEN2_TOKENIZER.is_dir():
        pytest.skip("shared test data (qwen2-tokenizer) not present")
    return load_tokenizer(str(QWEN2_TOKENIZER))


@pytest.fixture(scope="module")
def ami_raw(hf_cache):
    if not AMI.is_file():
        pytest.skip("shared test data (AMI) not present")
    return load_raw_splits(DataSettings(source=str(AMI), eval_fraction=0.0), cache_dir=hf_cache)["train"]


def answer_counts(ds) -> list[int]:
    return [sum(label != IGNORE_INDEX for label in labels) for labels in list(ds["labels"])]


def assert_well_formed(ds, max_len: int) -> None:
    """Every sample fits, has answer tokens, and is prompt (-100) then answer (labels == ids), in that order."""
    for ids, labels in zip(list(ds["input_ids"]), list(ds["labels"]), strict=True):
        assert len(ids) == len(labels) <= max_len
        n_prompt = sum(label == IGNORE_INDEX for label in labels)
        assert n_prompt < len(ids), "a sample without answer tokens"
        assert all(label == IGNORE_INDEX for label in labels[:n_prompt])
        assert labels[n_prompt:] == ids[n_prompt:]


# ---------------------------------------------------------------------------------------------------------------
# truncate_example (pure)


def test_short_sample_untouched_labels_mask_the_prompt():
    out = truncate_example([1, 2, 3], [7, 8], max_len=64, keep_prompt_head=1, keep_prompt_tail=1)
    assert out.input_ids == [1, 2, 3, 7, 8]
    assert out.labels == [IGNORE_INDEX] * 3 + [7, 8]
    assert not out.prompt_cut and not out.answer_cut


def test_long_prompt_cut_mid_keeping_head_and_tail():
    prompt, answer = list(range(100)), list(range(1000, 1010))
    out = truncate_example(prompt, answer, max_len=50, keep_prompt_head=8, keep_prompt_tail=4)
    assert out.input_ids == list(range(8)) + list(range(68, 100)) + answer
    assert len(out.input_ids) == 50
    assert out.labels == [IGNORE_INDEX] * 40 + answer
    assert out.prompt_cut and not out.answer_cut


def test_long_answer_cut_at_its_end_never_empty():
    prompt, answer = list(range(100)), list(range(1000, 1200))
    out = truncate_example(prompt, answer, max_len=64, keep_prompt_head=8, keep_prompt_tail=4, min_prompt_tokens=32)
    assert out.input_ids[32:] == answer[:32]  # answer keeps max_len - min_prompt_tokens, cut at its end
    assert out.input_ids[:32] == list(range(8)) + list(range(76, 100))
    assert out.prompt_cut and out.answer_cut
    short_prompt = truncate_example(
        prompt[:10], answer, max_len=64, keep_prompt_head=8, keep_prompt_tail=4, min_prompt_tokens=32
    )
    assert short_prompt.input_ids == prompt[:10] + answer[:54]  # a short prompt leaves the rest to the answer
    squeezed = truncate_example(
        prompt, answer, max_len=13, keep_prompt_head=8, keep_prompt_tail=4, min_prompt_tokens=500
    )
    assert squeezed.input_ids == list(range(8)) + list(range(96, 100)) + [1000]


def test_impossible_fit_raises_naming_the_minimum():
    with pytest.raises(ValueError, match=r"max_len >= 13"):
        truncate_example(list(range(100)), [1], max_len=12, keep_prompt_head=8, keep_prompt_tail=4)
    with pytest.raises(ValueError, match="answer"):
        truncate_example([1, 2], [], max_len=64, keep_prompt_head=1, keep_prompt_tail=1)


def test_random_shapes_fit_with_head_tail_and_answer():
    rng = random.Random(0)
    for _ in range(500):
        head, tail = rng.randint(0, 20), rng.randint(0, 20)
        max_len = rng.randint(head + tail + 1, 300)
        prompt = [rng.randrange(10**6) for _ in range(rng.randint(0, 400))]
        answer = [rng.randrange(10**6) for _ in range(rng.randint(1, 400))]
        out = truncate_example(prompt, answer, max_len, head, tail, min_prompt_tokens=rng.choice([None, max_len // 2]))
        n_prompt = out.labels.count(IGNORE_INDEX)
        assert len(out.input_ids) == min(max_len, len(prompt) + len(answer))
        assert 1 <= len(out.input_ids) - n_prompt
        assert out.labels[n_prompt:] == out.input_ids[n_prompt:] == answer[: len(out.input_ids) - n_prompt]
        kept = out.input_ids[:n_prompt]
        if out.prompt_cut:
            assert kept[:head] == prompt[:head] and n_prompt >= head + tail
            assert kept[head:] == prompt[len(prompt) - (n_prompt - head) :]
        else:
            assert kept == prompt


# ---------------------------------------------------------------------------------------------------------------
# Settings and synthetic data


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"max_seq_len": 40}, rf"max_seq_len=40: must be >= {MIN_MAX_SEQ_LEN}.*prompt head.*answer"),
        ({"eval_fraction": 1.0}, r"eval_fraction=1.0: must be in \[0, 1\)"),
        ({"source": "meetings.txt"}, r"unknown file extension '\.txt'.*\.jsonl, \.json, \.csv, \.parquet"),
        ({"summary_column": "dialogue"}, r"dialogue_column and summary_column are both"),
        ({"source": " "}, r"DataSettings.source is empty"),
    ],
)
def test_settings_errors_name_field_and_allowed_values(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        DataSettings(**overrides)


def test_synthetic_meetings_are_deterministic_by_seed():
    first = generate_synthetic_meetings(12, seed=3)
    assert first == generate_synthetic_meetings(12, seed=3)
    assert first[:5] == generate_synthetic_meetings(5, seed=3)
    other = generate_synthetic_meetings(12, seed=4)
    assert all(a["dialogue"] != b["dialogue"] for a, b in zip(first, other, strict=True))


def test_synthetic_meetings_ami_like_and_faithful():
    meetings = generate_synthetic_meetings(200, seed=0)
    assert all(set(m) == {"id", "dialogue", "summary"} for m in meetings)
    assert len({m["id"] for m in meetings}) == 200
    words = [len(m["dialogue"].split()) for m in meetings]
    assert 200 <= min(words) and max(words) <= 1600 and max(words) - min(words) > 800
    assert all(40 <= len(m["summary"].split()) <= 150 for m in meetings)
    for m in meetings:
        phase = re.search(r"This is our (.+?) meeting", m["dialogue"]).group(1)
        assert f"In the {phase} meeting" in m["summary"]
        recap = re.search(r"So, to sum up\. (.+?)\. Okay", m["dialogue"]).group(1)
        decisions = [item.split(": ", 1)[1] for item in recap.split("; ")]
        assert 2 <= len(decisions) <= 4
        for decision in decisions:
            assert decision in m["summary"], (decision, m["summary"])
            assert m["dialogue"].count(decision) >= 2  # proposed/decided in the discussion, and in the recap


# ---------------------------------------------------------------------------------------------------------------
# Sources


ROWS = [
    {"transcript": f"Meeting {i}: we talked about the remote.", "abstract": f"Summary {i}.", "extra": i}
    for i in range(8)
]


def write_rows(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_local_files_load_columns_drop_empty_rows(tmp_path, hf_cache, suffix):
    rows = ROWS + [
        {"transcript": "Nothing was summarised.", "abstract": None, "extra": 8},
        {"transcript": "   ", "abstract": "Empty meeting.", "extra": 9},
    ]
    path = write_rows(tmp_path / f"meetings{suffix}", rows)
    settings = DataSettings(
        source=str(path), dialogue_column="transcript", summary_column="abstract", eval_fraction=0.25, data_seed=1
    )
    splits = load_raw_splits(settings, cache_dir=hf_cache)
    assert splits["train"].column_names == splits["eval"].column_names == ["dialogue", "summary"]
    assert (len(splits["train"]), len(splits["eval"])) == (6, 2)
    loaded = sorted(list(splits["train"]["dialogue"]) + list(splits["eval"]["dialogue"]))
    assert loaded == sorted(r["transcript"] for r in ROWS)
    again = load_raw_splits(settings, cache_dir=hf_cache)
    assert list(again["eval"]["dialogue"]) == list(splits["eval"]["dialogue"])  # hold-out deterministic by seed


def test_folder_validation_file_is_the_eval_split(tmp_path, hf_cache):
    folder = tmp_path / "ami_like"
    folder.mkdir()
    write_rows(folder / "train.jsonl", ROWS[:6])
    write_rows(folder / "validation.jsonl", ROWS[6:])
    settings = DataSettings(source=str(folder), dialogue_column="transcript", summary_column="abstract")
    splits = load_raw_splits(settings, cache_dir=hf_cache)
    assert list(splits["eval"]["summary"]) == ["Summary 6.", "Summary 7."]
    assert len(splits["train"]) == 6


def test_missing_column_names_setting_and_columns(tmp_path, hf_cache):
    path = write_rows(tmp_path / "meetings.jsonl", ROWS)
    with pytest.raises(ValueError) as err:
        load_raw_splits(DataSettings(source=str(path), summary_column="abstract"), cache_dir=hf_cache)
    message = str(err.value)
    assert "'dialogue'" in message and "--dialogue-column" in message
    assert "['transcript', 'abstract', 'extra']" in message
    assert "--summary-column" not in message


def test_empty_sources_raise_naming_source_and_split(tmp_path, hf_cache):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl.*empty.*'train'"):
        load_raw_splits(DataSettings(source=str(empty)), cache_dir=hf_cache)
    header_only = tmp_path / "header.csv"
    header_only.write_text("dialogue,summary\n")
    with pytest.raises(ValueError, match=r"header\.csv.*no rows"):
        load_raw_splits(DataSettings(source=str(header_only)), cache_dir=hf_cache)
    blank = write_rows(tmp_path / "blank.jsonl", [{"dialogue": "Hi.", "summary": ""}, {"dialogue": "", "summary": "x"}])
    with pytest.raises(ValueError, match=r"blank\.jsonl.*all 2 rows of split 'train' have an empty"):
        load_raw_splits(DataSettings(source=str(blank)), cache_dir=hf_cache)


def test_missing_file_and_unknown_extension_raise(tmp_path, hf_cache):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*no such file"):
        load_raw_splits(DataSettings(source=str(tmp_path / "nope.jsonl")), cache_dir=hf_cache)
    odd = tmp_path / "meetings.yaml"
    odd.write_text("a: b\n")
    with pytest.raises(ValueError, match=r"unknown file extension '\.yaml'"):
        DataSettings(source=str(odd))


def test_synthetic_holds_out_eval_missing_split_named(hf_cache):
    splits = load_raw_splits(DataSettings(source="synthetic", num_synthetic=40, eval_fraction=0.1))
    assert (len(splits["train"]), len(splits["eval"])) == (36, 4)
    assert len(load_raw_splits(DataSettings(source="synthetic", num_synthetic=40, eval_fraction=0.0))["eval"]) == 0
    with pytest.raises(ValueError, match=r"split='test' not in 'synthetic'; available splits: \['train'\]"):
        load_raw_splits(DataSettings(source="synthetic", split="test", num_synthetic=4))


# ---------------------------------------------------------------------------------------------------------------
# Tokenization: real AMI through the real Qwen2 tokenizer and the embedded tiny one


@needs_shared_data
def test_real_ami_qwen2_chatml_fits_512_counting_cuts(ami_raw, qwen_tokenizer):
    settings = DataSettings(source=str(AMI), max_seq_len=512)
    assert template_overhead(qwen_tokenizer, settings.instruction) == (11, 5)
    ds, report = tokenize_dataset(ami_raw, qwen_tokenizer, settings)
    assert ds.column_names == ["input_ids", "labels"]
    assert_well_formed(ds, 512)
    # Transcripts are 978-12875 tokens: every prompt is cut. Answers may take 256 tokens (half of 512); two
    # summaries (255 and 608 tokens, + <|im_end|>\n) exceed that.
    assert report == TruncationReport(samples=142, prompt_cut=142, answer_cut=2, max_len=512)
    assert str(report) == "142 samples, 142 prompts and 2 answers cut to 512 tokens"
    assert sum(n == 256 for n in answer_counts(ds)) == 2 and min(answer_counts(ds)) >= 40
    head = qwen_tokenizer("<|im_start|>user\nSummarize the following meeting transcript.\n\n")["input_ids"]
    generation_prompt = qwen_tokenizer("<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    for ids, n_answer in zip(list(ds["input_ids"]), answer_counts(ds), strict=True):
        assert ids[: len(head)] == head
        assert ids[-n_answer - len(generation_prompt) : -n_answer] == generation_prompt
    full_answers = [ids[-2:] for ids, n in zip(list(ds["input_ids"]), answer_counts(ds), strict=True) if n < 256]
    assert all(tail == qwen_tokenizer("<|im_end|>\n")["input_ids"] for tail in full_answers)


@needs_shared_data
def test_real_ami_tiny_tokenizer_fits_with_answers(ami_raw, tiny_tokenizer):
    ds, report = tokenize_dataset(ami_raw, tiny_tokenizer, DataSettings(source=str(AMI), max_seq_len=512))
    assert_well_formed(ds, 512)
    assert report.samples == report.prompt_cut == 142
    assert 0 < report.answer_cut < 142  # the tiny vocabulary spends more tokens on real English summaries


def test_synthetic_tiny_tokens_match_chat_encoding(tiny_tokenizer):
    settings = DataSettings(source="synthetic", num_synthetic=24, max_seq_len=256, eval_fraction=0.0)
    raw = load_raw_splits(settings)["train"]
    ds, report = tokenize_dataset(raw, tiny_tokenizer, settings)
    assert_well_formed(ds, 256)
    assert report.samples == 24 and report.prompt_cut > 0
    long = DataSettings(source="synthetic", num_synthetic=24, max_seq_len=8192, eval_fraction=0.0)
    untruncated, report = tokenize_dataset(raw, tiny_tokenizer, long)
    assert report == TruncationReport(24, 0, 0, 8192)
    row = raw[0]
    messages = [
        {"role": "user", "content": f"{long.instruction}\n\n{row['dialogue']}"},
        {"role": "assistant", "content": row["summary"]},
    ]
    full = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert tiny_tokenizer.decode(untruncated[0]["input_ids"]) == full
    n_answer = answer_counts(untruncated)[0]
    assert tiny_tokenizer.decode(untruncated[0]["input_ids"][-n_answer:]) == row["summary"] + "<|im_end|>\n"


def test_max_seq_len_below_template_names_the_minimum(tiny_tokenizer):
    settings = DataSettings(source="synthetic", max_seq_len=64, instruction="Summarize. " * 20)
    raw = load_raw_splits(DataSettings(source="synthetic", num_synthetic=4, eval_fraction=0.0))["train"]
    with pytest.raises(ValueError, match=r"max_seq_len=64 is too small.*max_seq_len >= \d+"):
        tokenize_dataset(raw, tiny_tokenizer, settings)


def test_empty_split_tokenizes_to_an_empty_dataset(tiny_tokenizer):
    settings = DataSettings(source="synthetic", num_synthetic=4, eval_fraction=0.0)
    ds, report = tokenize_dataset(load_raw_splits(settings)["eval"], tiny_tokenizer, settings)
    assert len(ds) == 0 and ds.column_names == ["input_ids", "labels"] and report.samples == 0


def test_template_list_or_batch_encoding_same_ids():
    from transformers import BatchEncoding

    ids = [[1, 2, 3], [4, 5]]
    assert _id_lists(ids) == _id_lists(BatchEncoding({"input_ids": ids})) == _id_lists({"input_ids": ids}) == ids


# ---------------------------------------------------------------------------------------------------------------
# Collation and the epoch loader


def test_collator_right_pads_to_eight_counts_real(tiny_tokenizer):
    """Right padding to a multiple of 8 tokens, the alignment sdpa's mask needs on a GPU (test_packing.py's
    cuda test); padding carries no loss and is not counted."""
    collate = make_collator(tiny_tokenizer)
    batch = collate(
        [
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
            {"input_ids": [8, 9, 10, 11, 12], "labels": [-100, -100, 10, 11, 12]},
        ]
    )
    pad = tiny_tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [[5, 6, 7] + [pad] * 5, [8, 9, 10, 11, 12] + [pad] * 3]
    assert batch["labels"].tolist() == [[-100, 6, 7] + [-100] * 5, [-100, -100, 10, 11, 12] + [-100] * 3]
    assert batch["attention_mask"].tolist() == [[1] * 3 + [0] * 5, [1] * 5 + [0] * 3]
    assert count_tokens(batch) == 8


def ids_of(batch: list[dict]) -> list[int]:
    return [sample["input_ids"][0] for sample in batch]


def index_dataset(n: int) -> list[dict]:
    return [{"input_ids": [i], "labels": [i]} for i in range(n)]


def loaders(n: int, micro_batch: int = 3, seed: int = 0) -> list[EpochLoader]:
    return [EpochLoader(index_dataset(n), ids_of, micro_batch, rank, world_size=2, seed=seed) for rank in range(2)]


def epoch_ids(loader: EpochLoader, epoch: int, start_sample: int = 0) -> list[list[int]]:
    return list(loader.epoch(epoch, start_sample))


@pytest.mark.parametrize("n", [24, 20])
def test_2_ranks_get_disjoint_shards_covering_the_data(n):
    rank0, rank1 = loaders(n)  # micro-batch 3, effective batch 6
    kept = n // 6 * 6
    a = [i for batch in epoch_ids(rank0, 0) for i in batch]
    b = [i for batch in epoch_ids(rank1, 0) for i in batch]
    assert len(a) == len(b) == kept // 2 and not set(a) & set(b)
    order = [i for batch in epoch_ids(EpochLoader(index_dataset(n), ids_of, 1, 0, 1, seed=0), 0) for i in batch]
    assert sorted(a + b) == sorted(order[:kept]), "the dropped samples are the last of the global order"
    assert sorted(a + b) == list(range(n)) if n == kept else len(set(a + b)) == kept
    assert len(rank0) == len(rank1) == kept // 6
    assert [len(batch) for batch in epoch_ids(rank0, 0)] == [3] * (kept // 6), "whole micro-batches only"


def test_each_epoch_reshuffles_same_seed_same_order():
    rank0, _ = loaders(20)
    assert epoch_ids(rank0, 0) != epoch_ids(rank0, 1)
    assert epoch_ids(rank0, 1) == epoch_ids(loaders(20)[0], 1)
    assert epoch_ids(rank0, 0) == epoch_ids(rank0, 0)
    assert epoch_ids(rank0, 0) != epoch_ids(loaders(20, seed=1)[0], 0)


def test_loader_without_an_epoch_raises_type_error():
    rank0, _ = loaders(20)
    with pytest.raises(TypeError, match=r"\.epoch\("):
        iter(rank0)
    with pytest.raises(TypeError):
        for _ in rank0:
            pass


def test_start_sample_yields_exactly_the_epoch_tail():
    calls = []
    loader = EpochLoader(index_dataset(20), lambda b: calls.append(ids_of(b)) or ids_of(b), 3, 1, 2, seed=7)
    full = epoch_ids(loader, 5)
    assert len(full) == len(loader) == 3  # effective batch 6: 3 steps
    for step in range(len(loader) + 1):
        calls.clear()
        assert epoch_ids(loader, 5, start_sample=step * 6) == full[step:]
        assert calls == full[step:]
    with pytest.raises(ValueError, match=r"start_sample=24: .*3 steps of 6 samples"):
        loader.epoch(5, start_sample=24)


def test_loader_batches_tokenized_samples_collated(tiny_tokenizer):
    settings = DataSettings(source="synthetic", num_synthetic=8, max_seq_len=128, eval_fraction=0.0)
    ds, _ = tokenize_dataset(load_raw_splits(settings)["train"], tiny_tokenizer, settings)
    loader = EpochLoader(ds, make_collator(tiny_tokenizer), micro_batch=2, rank=0, world_size=2, seed=0)
    batches = list(loader.epoch(0))
    assert len(batches) == len(loader) == 2
    assert all(b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape for b in batches)
    assert sum(count_tokens(b) for b in batches) == sum(int(b["attention_mask"].sum()) for b in batches) <= 4 * 128


def step_samples(n, effective_batch, world_size, micro_batch, epoch=0, start_sample=0, seed=0) -> list[list[int]]:
    """Each optimizer step's samples (sorted) over all ranks, grouped as the loop groups micro-batches."""
    accumulation = effective_batch // (micro_batch * world_size)
    per_rank = []
    for rank in range(world_size):
        loader = EpochLoader(
            index_dataset(n), ids_of, micro_batch, rank, world_size, seed, effective_batch=effective_batch
        )
        batches = list(loader.epoch(epoch, start_sample=start_sample))
        assert len(batches) == len(loader) - start_sample // (micro_batch * world_size)
        per_rank.append([sum(batches[i : i + accumulation], []) for i in range(0, len(batches), accumulation)])
    assert len({len(steps) for steps in per_rank}) == 1, "ranks disagree on the number of steps"
    return [sorted(sum(parts, [])) for parts in zip(*per_rank, strict=True)]


def test_7_samples_batch_2_are_3_steps_on_1_or_2_ranks():
    for epoch in (0, 1):
        one, two = step_samples(7, 2, 1, 1, epoch), step_samples(7, 2, 2, 1, epoch)
        assert one == two, "a step trains the same samples on any world size"
        assert len(two) == 3 and all(len(step) == 2 for step in two)
        seen = sum(two, [])
        assert len(set(seen)) == len(seen) == 6, "no sample twice, the trailing partial batch dropped"


@pytest.mark.parametrize("n", [24, 29])
def test_a_step_reads_same_samples_on_any_layout(n):
    """Step s covers positions [s*E, (s+1)*E) of the epoch's global order (DistributedSampler's permutation, seeded
    by seed + epoch), however world_size x micro_batch x accumulation splits the effective batch E."""
    reference = step_samples(n, 8, 1, 8, epoch=3)
    assert len(reference) == n // 8 and len(set(sum(reference, []))) == n // 8 * 8
    for world_size, micro_batch in [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)]:
        assert step_samples(n, 8, world_size, micro_batch, epoch=3) == reference, (world_size, micro_batch)
    assert step_samples(n, 8, 2, 2, epoch=4) != reference


def test_resume_at_sample_position_on_another_layout():
    full = step_samples(31, 6, 2, 1, epoch=2)
    assert len(full) == 5
    for world_size, micro_batch in [(1, 1), (1, 3), (1, 6), (2, 3), (3, 1), (3, 2), (6, 1)]:
        for step in range(len(full) + 1):
            resumed = step_samples(31, 6, world_size, micro_batch, epoch=2, start_sample=step * 6)
            assert resumed == full[step:], (world_size, micro_batch, step)


def test_resume_off_a_step_or_past_the_epoch_refused():
    loader = EpochLoader(index_dataset(22), ids_of, 1, 0, 2, seed=0, effective_batch=4)  # 5 steps, 2 samples dropped
    with pytest.raises(ValueError, match=r"start_sample=6: .*multiple of the effective batch \(4\)"):
        loader.epoch(0, start_sample=6)
    with pytest.raises(ValueError, match=r"start_sample=24: .*5 steps of 4 samples"):
        loader.epoch(0, start_sample=24)


def test_check_resume_takes_same_effective_batch_only():
    saved = DataLayout(train_samples=61, seed=0, effective_batch=8, world_size=2, micro_batch=2)
    for world_size, micro_batch in [(1, 1), (1, 8), (2, 4), (4, 2), (8, 1)]:
        check_resume(saved, DataLayout(61, 0, 8, world_size, micro_batch), sample_in_epoch=24)
    refused = {
        DataLayout(61, 0, 4, 1, 2): "--effective-batch 8",
        DataLayout(60, 0, 8, 2, 2): "training set",
        DataLayout(61, 1, 8, 2, 2): "--seed 0",
    }
    for current, fix in refused.items():
        with pytest.raises(ValueError) as error:
            check_resume(saved, current, sample_in_epoch=24)
        message = str(error.value)
        assert saved.describe() in message and current.describe() in message and fix in message, message
    assert "2 ranks x micro-batch 2 x accumulation 2" in saved.describe()
    with pytest.raises(ValueError, match="effective_batch=8 is not divisible by micro_batch=3 x world_size=2"):
        DataLayout(61, 0, 8, 2, 3)


def test_tokenizer_builds_without_the_data_pipeline():
    """The tokenizer is the pipeline's lowest stage: of ddp_ft it imports the synthetic generator and nothing else
    (no source, formatting or loader), so every stage may use it."""
    from ..helpers.imports import import_graph

    assert import_graph()["ddp_ft.training.data.tokenizer"] == {"ddp_ft.training.data.synthetic"}


def test_a_cut_names_longest_sample_and_setting(tiny_tokenizer):
    """The truncation report measures the longest sample before cutting (what --max-seq-len must reach to keep every
    sample whole), and its advice names the setting; data that fits gets no advice."""
    settings = DataSettings(source="synthetic", num_synthetic=24, max_seq_len=256, eval_fraction=0.0)
    raw = load_raw_splits(settings)["train"]
    whole, fits = tokenize_dataset(raw, tiny_tokenizer, replace(settings, max_seq_len=8192))
    longest = max(len(ids) for ids in whole["input_ids"])
    _, cut = tokenize_dataset(raw, tiny_tokenizer, settings)
    assert cut.longest == fits.longest == longest > 256
    assert fits.advice() is None
    advice = cut.advice()
    assert f"raise --max-seq-len (up to {longest} keeps every sample whole" in advice
    assert advice.startswith(f"24 samples, {cut.prompt_cut} prompts")
