"""Random PEFT LoRA adapters for the LoRA tests (B not zero, unlike PEFT's initialisation)."""

from __future__ import annotations

import copy


def make_adapter(base, rank: int, alpha: float, use_rslora: bool, targets: list[str], directory, seed: int):
    """Save a random LoRA adapter of `base` (a transformers model) to `directory`; returns the PEFT
    model (the reference: base + adapter)."""
    import peft
    import torch

    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, use_rslora=use_rslora, target_modules=targets, lora_dropout=0.0
    )
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero: the adapter would change nothing
                param.copy_(0.15 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model
