"""LoRA adapters: how many, of what rank, kept where."""

from __future__ import annotations

from dataclasses import dataclass, field

from xlaserve.config.checks import require
from xlaserve.config_args import arg


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names): adapters in fixed device slots, `max_loras` of them per step,
    each of rank at most `max_lora_rank`; `max_cpu_loras` adapters kept loaded in host memory."""

    enable_lora: bool = field(default=False, metadata=arg("serve LoRA adapters"))
    max_loras: int = field(default=1, metadata=arg("adapters in one step (device slots; default 1)"))
    max_lora_rank: int = field(default=16, metadata=arg("the largest adapter rank (default 16)"))
    max_cpu_loras: int | None = field(  # None: max_loras
        default=None, metadata=arg("adapters kept in host memory (default: max-loras)")
    )

    def __post_init__(self):
        require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        require(
            1 <= self.max_lora_rank <= 512, f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}"
        )
        require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
        )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
