"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory, named and numbered by the caller.

    `lora_int_id` (>= 1) identifies the adapter inside the engine: its slot, its host copy, and its
    prefix-cache blocks (no block is shared across adapters). Two requests with the same id must
    name the same adapter.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's directory, got {self.lora_path!r}")
