"""The end-to-end benchmark's numbers: ratios paired within each repeat, and the loss check.

- ``ddp_over_pair_<entry>``: DDP over two independent processes.
- ``vs_stock``: ddp_ft over what a user would run instead (``STOCK_PAIRS``).
- ``STOCK_STEPS``: the chain from the stock Trainer to ddp_ft's default, one change per link.
- ``loss_check``: whether paired runs are the same training.
"""

from __future__ import annotations

import math
import statistics

from .runs import BASE, config_of

ENTRIES = ("loop", "recipe")
TARGET = 0.95  # the goal: 2-rank DDP at >= 0.95 of the independent pair
# (ddp_ft, stock) pairs of the headline; the goal: ddp_ft / stock >= 1.10 on mixed, >= 1.00 on tiny.
STOCK_PAIRS = (("ddp-recipe", "stock-recipe"), ("ddp-recipe", "stock-recipe-unused-off"), ("ddp-trl", "stock-trl"))
STOCK_PAIRS += (("ddp-dpo", "stock-dpo"), ("ddp-dpo-strided", "stock-dpo"))
STOCK_TARGET = {"mixed": 1.10, "tiny": 1.00}
# From the stock Trainer to ddp_ft's default, one change per link: (to, from, what changes).
STOCK_STEPS = (
    ("stock-recipe-unused-off", "stock-recipe", "torch DDP without the unused-parameter walk"),
    ("ddp-recipe-strided", "stock-recipe-unused-off", "BucketedTrainer, the stock order: one collective per step"),
    ("ddp-recipe", "ddp-recipe-strided", "the balanced plan: less padding, less waiting for the slower rank"),
)
# the stock order on both sides: the same micro-batches, so the same losses to float rounding
EXACT_PAIRS = (("ddp-recipe-strided", "stock-recipe-unused-off"), ("ddp-recipe-strided", "stock-recipe"))
EXACT_PAIRS += (("ddp-dpo-strided", "stock-dpo"),)
EXACT = 1e-5  # the stock order: relative loss difference allowed (float32 rounding of the same sums)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def _paired(a: list[dict], b: list[dict], key: str) -> dict | None:
    pairs = [(x[key], y[key]) for x, y in zip(a, b, strict=True)]
    if not pairs or any(x is None or y is None for x, y in pairs):
        return None
    return spread([x / y for x, y in pairs])


def summarize(runs: dict[str, dict[str, list[dict]]], ceiling: dict[str, float]) -> dict:
    """Per data set, each configuration's numbers and the paired ratios."""
    summary = {}
    for data, by_config in runs.items():
        s = summary[data] = {}
        for config, rs in by_config.items():
            s[config] = {"tokens_per_s": spread([r["tokens_per_s"] for r in rs])}
            walls = [r.get("wall_tokens_per_s") for r in rs]
            s[config]["wall_tokens_per_s"] = spread(walls) if None not in walls else None
            keys = ["compute_ms_per_1k_tokens", "wait_share", "eval_loss"]
            keys += ["imbalance", "wait_for_slowest_ms", "exposed_comm_ms"] if config_of(config).kind == "ddp" else []
            for key in keys:
                values = [r[key] for r in rs if r.get(key) is not None]
                s[config][key] = statistics.median(values) if values else None
        s["plan_ceiling"] = ceiling[data]
        _against_the_limit(s, by_config, ceiling[data])
        _against_stock(s, by_config)
    return summary


def _against_the_limit(s: dict, by_config: dict[str, list[dict]], ceiling: float) -> None:
    for entry in ENTRIES:
        for suffix in ("", BASE):
            ddp, pair = by_config.get(f"ddp-{entry}{suffix}"), by_config.get(f"pair-{entry}")
            if ddp is None or pair is None:
                continue
            ratios = _paired(ddp, pair, "tokens_per_s")
            s[f"ddp_over_pair_{entry}{suffix}"] = ratios
            # the same ratio over the plan's ceiling
            s[f"ddp_over_ceiling_{entry}{suffix}"] = spread([r / ceiling for r in ratios["all"]])
            # the same ratio had no rank waited for the slower one
            no_wait = [d["no_wait_tokens_per_s"] for d in ddp]
            if None not in no_wait:
                s[f"no_wait_ddp_over_pair_{entry}{suffix}"] = spread(
                    [n / q["tokens_per_s"] for n, q in zip(no_wait, pair, strict=True)]
                )
        if f"ddp-{entry}{BASE}" in by_config:
            s[f"ddp_over_baseline_{entry}"] = _paired(
                by_config[f"ddp-{entry}"], by_config[f"ddp-{entry}{BASE}"], "tokens_per_s"
            )


def _against_stock(s: dict, by_config: dict[str, list[dict]]) -> None:
    vs, chain, losses = {}, [], {}
    for ours, stock in STOCK_PAIRS:
        if ours in by_config and stock in by_config:
            a, b = by_config[ours], by_config[stock]
            vs[f"{ours}/{stock}"] = {"step": _paired(a, b, "tokens_per_s"), "wall": _paired(a, b, "wall_tokens_per_s")}
            losses[f"{ours}/{stock}"] = loss_check(a[0], b[0], exact=False)
    for to, frm, what in STOCK_STEPS:
        if to in by_config and frm in by_config:
            a, b = by_config[to], by_config[frm]
            step = {"to": to, "from": frm, "what": what, "step": _paired(a, b, "tokens_per_s")}
            chain.append(step | {"wall": _paired(a, b, "wall_tokens_per_s")})
    for strided, stock in EXACT_PAIRS:
        if strided in by_config and stock in by_config:
            losses[f"{strided}/{stock}"] = loss_check(by_config[strided][0], by_config[stock][0], exact=True)
    if vs:
        s["vs_stock"] = vs
    if chain:
        s["stock_chain"] = chain
    if losses:
        s["loss_check"] = losses


def loss_check(ours: dict, stock: dict, exact: bool) -> dict:
    """Whether two runs are the same training, from their losses.

    ``exact`` asks every step's loss within ``EXACT``. Otherwise the second half's mean loss and the final eval
    loss must agree within two standard errors.
    """
    a, b = ours["losses"], stock["losses"]
    if len(a) != len(b) or not a:
        return {"same": False, "why": f"{len(a)} and {len(b)} steps"}
    if exact:
        worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))
        return {"same": worst <= EXACT, "max_relative_difference": worst, "bound": EXACT}
    half = len(a) // 2
    tail_a, tail_b = a[half:], b[half:]
    se = math.sqrt((statistics.pvariance(tail_a) + statistics.pvariance(tail_b)) / len(tail_a))
    difference = statistics.mean(tail_a) - statistics.mean(tail_b)
    result = {"mean_loss_difference": difference, "bound": 2 * se, "same": abs(difference) <= 2 * se}
    if ours.get("eval_loss") is not None and stock.get("eval_loss") is not None:
        result["eval_loss"] = [ours["eval_loss"], stock["eval_loss"]]
        result["same"] = result["same"] and abs(ours["eval_loss"] - stock["eval_loss"]) <= 2 * se
    return result


def pool(results: list[dict]) -> dict[str, dict[str, dict]]:
    """Pool the DDP-over-pair ratios of several runs, per data set and entry point.

    One run's median moves with the host more than the target allows, so repeats are pooled.

    Raises:
        ValueError: if the runs differ in length.
    """
    steps = {r["settings"]["max_steps"] for r in results}
    if len(steps) > 1:
        raise ValueError(f"runs of different --max-steps ({sorted(steps)}) are not the same measurement: pool one")
    pooled: dict[str, dict[str, dict]] = {}
    for result in results:
        for data, by_key in result["summary"].items():
            ceiling = by_key.get("plan_ceiling")
            for entry in ENTRIES:
                ratios = (by_key.get(f"ddp_over_pair_{entry}") or {}).get("all", [])
                if not ratios:
                    continue
                slot = pooled.setdefault(data, {}).setdefault(entry, {"runs": 0, "all": [], "over_ceiling": []})
                slot["runs"] += 1
                slot["all"] += ratios
                slot["over_ceiling"] += [r / ceiling for r in ratios] if ceiling else []
    for by_entry in pooled.values():
        for slot in by_entry.values():
            ratios, over = slot.pop("all"), slot["over_ceiling"]
            slot.update(
                repeats=len(ratios),
                ratio=spread(ratios),
                at_target=sum(r >= TARGET for r in ratios),
                over_ceiling=spread(over) if over else None,
                over_ceiling_repeats=len(over),
            )
    return pooled
