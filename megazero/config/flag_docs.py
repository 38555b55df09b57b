"""docs/flags.md from the flag table (``flags.FLAGS``) and the DeepSpeed key table (``ds_keys.DS_KEYS``): one
table per group, the refused flags that share a message in one row. ``python -m megazero.config.flag_docs
> docs/flags.md`` writes it; a test fails while the file and the tables differ."""

from __future__ import annotations

import sys
from typing import Any

from megazero.config.flags import FLAGS, Flag, _shown

__all__ = ["flags_markdown"]


def _spelling(f: Flag) -> str:
    names = ", ".join(f"`{n}`" for n in f.names)
    if f.metavar:
        names += " " + " ".join(f.metavar)
    elif f.choices:
        names += " {" + ",".join(str(c) for c in f.choices) + "}"
    elif f.type is not None:
        names += " N" if f.type in (int, float) else " X"
    return names


def _table(rows: list[list[Any]]) -> list[str]:
    return [f"| {', '.join(names)} | {status} | {shown} | {meaning.replace('|', '/')} |"
            for names, status, shown, meaning in rows]


def flags_markdown() -> str:
    """docs/flags.md: the flag table and the DeepSpeed JSON key table."""
    from megazero.config.ds_keys import DS_KEYS

    lines = ["# Command-line flags and DeepSpeed JSON keys", "",
             "Generated from `megazero/config/flags.py` and `megazero/config/ds_keys.py` by "
             "`python -m megazero.config.flag_docs > docs/flags.md`; a test fails when this file and the tables differ.",
             "", "**honoured**: Megatron's meaning, implemented. **mapped**: Megatron's intent, met by the megazero "
             "mechanism named. **refused**: the run stops before any process group starts, with the message shown. "
             "Nothing is silently ignored. **default**: the value in force when the flag is not given (blank: "
             "none, or it comes from the data, the preset or the DeepSpeed JSON). `pretrain_gpt.py --help` lists the "
             "honoured and mapped flags, less the mapped ones accepted with no effect.", "",
             "Every flag of Megatron-LM's `megatron/training/arguments.py` has a row: a test holds this table against "
             "the list in `tests/training/megatron_lm_flags.txt` (its header names the Megatron-LM commit; "
             "`scripts/megatron_flag_list.py` writes it from Megatron-LM's own parser), so a new Megatron-LM flag "
             "fails a test rather than a launch. Accepted with no effect are only the flags that choose how Megatron "
             "computes or communicates what megazero computes too, with the same result (a fused kernel, a bucket "
             "size), and switches that turn off something megazero does not do; a flag that asks for a capability "
             "megazero lacks is refused, naming what to use. The groups \"not in megazero\" hold the Megatron-LM "
             "features megazero does not have.", ""]
    current, rows = None, []  # rows: [spellings, status, default, meaning] of the group's table
    for f in FLAGS:
        if f.group != current:
            lines += _table(rows)
            current, rows = f.group, []
            lines += ["", f"## {current}", "", "| flag | status | default | meaning / megazero |", "|---|---|---|---|"]
        meaning = f.meaning
        if f.refuse_values:
            meaning += " Refused values: " + "; ".join(f"`{v}`" for v, _ in f.refuse_values) + "."
        if f.several is not None:
            meaning += " One value: several are refused."
        if f.only is not None:
            meaning = meaning.rstrip(".") + ". Only: " + ", ".join(f"`{_shown(v)}`" for v in f.only) + "."
        shown = "" if f.default is None else f"`{_shown(f.default)}`"
        if rows and rows[-1][1:] == [f.status, shown, meaning]:  # refused flags sharing a message: one row
            rows[-1][0].append(_spelling(f))
        else:
            rows.append([[_spelling(f)], f.status, shown, meaning])
    lines += _table(rows)
    lines += ["", "## DeepSpeed JSON keys (`--deepspeed_config`)", "",
              "**ignored** keys tune DeepSpeed's own internals and mean nothing here: they are accepted and listed "
              "in one line at start-up. Any key not in this table is refused as unknown.", "",
              "| key | status | meaning / megazero |", "|---|---|---|"]
    for k in DS_KEYS:
        lines.append(f"| `{k.path}` | {k.status} | {k.meaning.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(flags_markdown())  # the product (docs/flags.md's text), not a diagnostic
