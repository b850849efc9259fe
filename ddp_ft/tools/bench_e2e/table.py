"""The end-to-end benchmark's table (markdown) and picture (PNG)."""

from __future__ import annotations

from pathlib import Path

from .runs import BASE, CONFIGS, config_of
from .summary import ENTRIES, STOCK_TARGET, TARGET


def ordered(configs) -> list[str]:
    """Configurations in table order: CONFIGS, each DDP one followed by its baseline run."""
    order = [c for base in CONFIGS for c in (base, base + BASE)]
    return [c for c in order if c in configs]


def _ratio(spread: dict | None) -> str:
    return f"{spread['median']:.3f} ({spread['min']:.3f}..{spread['max']:.3f})" if spread else ""


def format_table(result: dict) -> str:
    """Every configuration's tokens/s and step split, then the limit, the baseline and the stock comparisons."""
    lines = [
        f"{result['command']}  ({result['hardware']})",
        "",
        "| data | run | tokens/s median (min..max) | DDP / pair median (min..max) | compute ms per 1k tokens "
        "| ranks' wait, share of step | DDP / pair had no rank waited | imbalance |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for data, by_config in result["summary"].items():
        for config in ordered(by_config):
            s, entry = by_config[config], config_of(config).entry
            suffix = BASE if config.endswith(BASE) else ""
            paired = config.removesuffix(BASE) == f"ddp-{entry}"
            ratio = by_config.get(f"ddp_over_pair_{entry}{suffix}") if paired else None
            no_wait = by_config.get(f"no_wait_ddp_over_pair_{entry}{suffix}") if paired else None
            t = s["tokens_per_s"]
            imbalance = f"{s['imbalance']:.3f}" if s.get("imbalance") is not None else ""
            compute = f"{s['compute_ms_per_1k_tokens']:.0f}" if s.get("compute_ms_per_1k_tokens") is not None else ""
            wait = f"{s['wait_share']:.1%}" if s.get("wait_share") is not None else ""
            lines.append(
                f"| {data} | {config} | {t['median']:,.0f} ({t['min']:,.0f}..{t['max']:,.0f}) | {_ratio(ratio)} | "
                f"{compute} | {wait} | {_ratio(no_wait)} | {imbalance} |"
            )
    ceilings = [
        f"{data} {by_config['plan_ceiling']:.3f}"
        for data, by_config in result["summary"].items()
        if by_config.get("plan_ceiling") is not None
    ]
    if ceilings:
        lines += [
            "",
            "plan ceiling (DDP / pair at best, from the padded tokens of the slowest rank): " + ", ".join(ceilings),
        ]
    of_ceiling = _per_entry(result, "ddp_over_ceiling")
    if of_ceiling:
        lines += ["DDP / pair over the plan ceiling (what the code and the machine cost): " + "; ".join(of_ceiling)]
    against = _per_entry(result, "ddp_over_baseline")
    if against:
        where = result.get("baseline_commit") or result.get("settings", {}).get("baseline")
        lines += ["", f"this checkout's DDP / the baseline's ({where}), paired per repeat: " + "; ".join(against)]
    return "\n".join(lines + format_stock(result))


def format_stock(result: dict) -> list[str]:
    """ddp_ft against the stock trainers (paired per repeat), the chain between them, and the loss check."""
    lines = []
    summary = result["summary"]
    if any("vs_stock" in s for s in summary.values()):
        lines += [
            "",
            "ddp_ft / stock, paired per repeat, median (min..max); target >= "
            + ", ".join(f"{STOCK_TARGET[d]:.2f} on {d}" for d in summary if d in STOCK_TARGET),
            "",
            "| data | ddp_ft / stock | step-timed tokens/s | wall tokens/s | target met (wall) |",
            "|---|---|---:|---:|---|",
        ]
        for data, s in summary.items():
            for pair, r in s.get("vs_stock", {}).items():
                target = STOCK_TARGET.get(data)
                met = "" if target is None or r["wall"] is None else ("yes" if r["wall"]["median"] >= target else "no")
                lines.append(f"| {data} | {pair} | {_ratio(r['step'])} | {_ratio(r['wall'])} | {met} |")
    if any("stock_chain" in s for s in summary.values()):
        lines += ["", "| data | from | to | what changes | step-timed | wall |", "|---|---|---|---|---:|---:|"]
        for data, s in summary.items():
            for link in s.get("stock_chain", []):
                lines.append(
                    f"| {data} | {link['from']} | {link['to']} | {link['what']} | {_ratio(link['step'])} | "
                    f"{_ratio(link['wall'])} |"
                )
    if any("loss_check" in s for s in summary.values()):
        lines += ["", "the same training (first repeat):"]
        for data, s in summary.items():
            for pair, check in s.get("loss_check", {}).items():
                lines.append(f"- {data} {pair}: {_loss_words(check)}")
    return lines


def _loss_words(check: dict) -> str:
    verdict = "same" if check["same"] else "DIFFERENT"
    if "why" in check:
        return f"{verdict} ({check['why']})"
    if "max_relative_difference" in check:
        return (
            f"{verdict}: every step's loss within {check['max_relative_difference']:.1e} (bound {check['bound']:.0e})"
        )
    words = (
        f"{verdict}: mean loss of the second half {check['mean_loss_difference']:+.4f} (bound +-{check['bound']:.4f})"
    )
    if "eval_loss" in check:
        words += f", eval loss {check['eval_loss'][0]:.4f} vs {check['eval_loss'][1]:.4f}"
    return words


def _per_entry(result: dict, key: str) -> list[str]:
    """``"<data> ddp-<entry> <ratio>"`` for every data set and entry point whose summary has ``<key>_<entry>``."""
    return [
        f"{data} ddp-{entry} {_ratio(by_config[f'{key}_{entry}'])}"
        for data, by_config in result["summary"].items()
        for entry in ENTRIES
        if by_config.get(f"{key}_{entry}")
    ]


def format_pool(pooled: dict[str, dict[str, dict]], files: list[str]) -> str:
    lines = [
        f"DDP / pair, every repeat of {len(files)} runs: " + ", ".join(files),
        "",
        f"| data | run | runs | repeats | DDP / pair median (min..max) | repeats at >= {TARGET} "
        "| over the plan ceiling (repeats with one) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for data, by_entry in pooled.items():
        for entry, s in by_entry.items():
            lines.append(
                f"| {data} | ddp-{entry} | {s['runs']} | {s['repeats']} | {_ratio(s['ratio'])} | "
                f"{s['at_target']} of {s['repeats']} | {_ratio(s['over_ceiling'])} ({s['over_ceiling_repeats']}) |"
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Bars of median tokens/s per run and data set, the min..max of the repeats as error bars; a DDP run's bar is
    labelled with DDP / pair, a stock run's with ddp_ft / it (wall tokens/s)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    datasets = list(result["summary"])
    configs = ordered({c for d in datasets for c in result["summary"][d] if c.removesuffix(BASE) in CONFIGS})
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        stats = [result["summary"][d].get(config, {}).get("tokens_per_s") for d in datasets]
        medians = [s["median"] if s else 0.0 for s in stats]
        errors = [[m - s["min"] if s else 0 for m, s in zip(medians, stats, strict=True)]]
        errors.append([s["max"] - m if s else 0 for m, s in zip(medians, stats, strict=True)])
        xs = [d + (i - (len(configs) - 1) / 2) * width for d in range(len(datasets))]
        hatch = "//" if config_of(config).stock else None
        bars = ax.bar(xs, medians, width, yerr=errors, capsize=3, label=config, hatch=hatch)
        ax.bar_label(bars, labels=[_bar_label(result["summary"][d], config) for d in datasets], padding=3, fontsize=7)
    ax.set_xticks(range(len(datasets)), [f"data: {d}" for d in datasets])
    ax.set(ylabel="tokens/s (median over repeats)", title="ddp_ft against the limit and against the stock trainers")
    ax.legend(ncols=3, fontsize=8)
    ax.margins(y=0.2)
    fig.savefig(path, dpi=110)
    return path


def _bar_label(s: dict, config: str) -> str:
    """A DDP run's DDP / pair; a stock run's ddp_ft / it (wall tokens/s), e.g. ``ddp_ft x1.07``."""
    entry, suffix = config_of(config).entry, BASE if config.endswith(BASE) else ""
    if config.removesuffix(BASE) == f"ddp-{entry}" and s.get(f"ddp_over_pair_{entry}{suffix}"):
        return f"{s[f'ddp_over_pair_{entry}{suffix}']['median']:.0%}"
    for pair, r in s.get("vs_stock", {}).items():
        if pair.endswith("/" + config) and r["wall"]:
            return f"ddp_ft x{r['wall']['median']:.2f}"
    return ""
