"""The one map from configuration field names (``num_layers``) to the command-line flags that set them
(``--num-layers``), so that a message raised deep in a config's validation reaches the user of the
command line in the words they typed."""

from __future__ import annotations

import functools
import re

from megazero.config.flags import FLAGS

__all__ = ["with_flags"]


# Fields whose flag is not their name with dashes (the rest come from the flag table).
_FIELD_FLAGS = {"layernorm_epsilon": "--norm-epsilon", "ffn_size": "--ffn-hidden-size",
                "moe_ffn_size": "--moe-ffn-hidden-size", "query_groups": "--num-query-groups",
                "vocab_padding_tp": "--tp", "context_parallel_size": "--cp", "expert_model_parallel_size": "--ep",
                "ffn size": "--ffn-hidden-size", "moe ffn size": "--moe-ffn-hidden-size"}


@functools.lru_cache(maxsize=1)
def _field_pattern() -> tuple[re.Pattern, dict[str, str]]:
    flags = {f.attr: min(f.names, key=len) for f in FLAGS  # a refused or no-effect flag is never the fix to name
             if "_" in f.attr and not f.attr.startswith("ds_") and f.in_help}
    flags.update(_FIELD_FLAGS)
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    # a field alone (not inside a flag, a JSON key, a path or a quoted name), with an optional =value
    return re.compile(rf"(?<![-\w./'])({names})\b(?:=('[^']*'|[^\s,;)]+))?"), flags


def with_flags(message: str) -> str:
    """``message`` with each configuration field (``num_layers``, ``attention_dropout=0.1``) named by its
    flag (``--num-layers``, ``--attention-dropout 0.1``), as a user of the command line types it."""
    pattern, flags = _field_pattern()

    def flag(m: re.Match) -> str:
        value = m.group(2)
        return flags[m.group(1)] + ("" if value is None else " " + value.strip("'"))

    # a message that names the flag beside the field ("set mamba_num_heads (--mamba-num-heads)") names it once
    return re.sub(r"(--[\w-]+(?: [^\s()]+)?) \(\1\)", r"\1", pattern.sub(flag, message))
