"""Predictions: what the trained model writes for prompts formatted as in training.

Generation is greedy, on one process and the unwrapped model, so it starts no collective.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .checkpoint import DATA_FILE
from .data import DataSettings, settings_from_record
from .data.prompts import Prompt, first_prompts
from .model.merge import MergeSettings, load_adapter_tokenizer, load_base_to_merge, plan_merge

logger = logging.getLogger(__name__)

PREDICTIONS_FILE = "predictions.jsonl"


@dataclass(frozen=True)
class Prediction:
    """One prompt, the model's output, and the row's own answer."""

    prompt: str
    prediction: str
    reference: str | None


def generate(model, tokenizer, prompts: Sequence[Prompt], max_new_tokens: int) -> list[Prediction]:
    """Greedy generation, one prompt at a time, until eos or ``max_new_tokens``.

    The key-value cache is used whatever the config says; training turns it off.

    Args:
        model (torch.nn.Module): the unwrapped causal LM.
        tokenizer (PreTrainedTokenizerBase): the run's.
        prompts (Sequence[Prompt]): from :func:`ddp_ft.training.data.prompts.prompt_of`.
        max_new_tokens (int): the most tokens written per prompt.

    Returns:
        list[Prediction]: one per prompt.
    """
    model.eval()
    device = next(model.parameters()).device
    predictions = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt.input_ids], device=device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                use_cache=True,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            written = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            predictions.append(Prediction(prompt.text, written.strip(), prompt.reference))
    return predictions


def rouge_l(predictions: Sequence[Prediction]) -> float | None:
    """Mean ROUGE-L F1 against the references; None when no row has one."""
    from rouge_score import rouge_scorer

    pairs = [(p.reference, p.prediction) for p in predictions if p.reference]
    if not pairs:
        return None
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return sum(scorer.score(ref, pred)["rougeL"].fmeasure for ref, pred in pairs) / len(pairs)


def write_predictions(path: str | Path, predictions: Sequence[Prediction]) -> Path:
    """Write one JSON object a line, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(asdict(p), ensure_ascii=False) + "\n" for p in predictions))
    tmp.replace(path)
    return path


def predict_rows(model, tokenizer, rows, data_settings, n: int, max_new_tokens: int) -> list[Prediction]:
    """Predictions for the first ``n`` standard rows."""
    return generate(model, tokenizer, first_prompts(rows, tokenizer, data_settings, n), max_new_tokens)


def prediction_table(predictions: Sequence[Prediction]) -> tuple[list[str], list[list[str]]]:
    """Columns and rows for a wandb table."""
    return ["prompt", "prediction", "reference"], [[p.prompt, p.prediction, p.reference or ""] for p in predictions]


@dataclass
class Trained:
    """A trained model ready to generate, and how its training wrote prompts.

    Args:
        model (torch.nn.Module): the adapted base, or a merged model.
        tokenizer (PreTrainedTokenizerBase): the one saved with it.
        data (DataSettings): the run's data settings.
        shape (str): its rows' standard shape.
    """

    model: torch.nn.Module
    tokenizer: object
    data: DataSettings
    shape: str


def load_trained(source: str | Path, settings: MergeSettings) -> Trained:
    """A run, an adapter folder or a merged model, loaded to generate with.

    An adapter goes on its base as training saw it, dequantised.

    Raises:
        FileNotFoundError: no model, or no ``ddp_ft_data.json`` beside it.
        ValueError: see ``plan_merge``.

    Example:
        >>> trained = load_trained("runs/demo/final", MergeSettings())
    """
    folder = Path(source)
    if (folder / "config.json").is_file() and (folder / DATA_FILE).is_file():  # a merged model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        data, shape = _data_record(folder)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=_merge_dtype(settings))
        return Trained(model, AutoTokenizer.from_pretrained(str(folder)), data, shape)
    from peft import PeftModel

    plan = plan_merge(source, settings)
    data, shape = _data_record(plan.adapter)
    tokenizer = load_adapter_tokenizer(plan)
    with warnings.catch_warnings():  # peft reads a deprecated attribute
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = PeftModel.from_pretrained(load_base_to_merge(plan), str(plan.adapter))
    return Trained(model, tokenizer, data, shape)


def _data_record(folder: Path) -> tuple[DataSettings, str]:
    path = folder / DATA_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} holds no {DATA_FILE}, so how training wrote its prompts is unknown. Generate from a run "
            "folder or adapter that ddp_ft saved (its final/ or a checkpoint's adapter/)."
        )
    return settings_from_record(json.loads(path.read_text()))


def _merge_dtype(settings: MergeSettings) -> torch.dtype | str:
    from .model.precision import DTYPES

    return DTYPES.get(settings.dtype, "auto")
