"""The benchmarks' models, built once here: the recipe's GPT-2 small, HF Llama / GPT-2 / T5, and ViT-B/16,
ResNet-50, ConvNeXt-T (timm's, or transformers' where timm is not installed); random weights, dropout off; and
their FLOP count for MFU."""

import importlib.util
from typing import Callable, Tuple

import torch
from torch import nn

from compile_trainer.telemetry.flops import grouped_query_attention_formulas
from compile_trainer_recipes.gpt import GPTConfig

GPT2_SMALL = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
TIMM_VIT_TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


class WithLoss(nn.Module):
    """A classifier whose forward returns the cross-entropy of its logits, so the loss is part of the model."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.net(pixel_values)
        if not isinstance(logits, torch.Tensor):  # transformers' ImageClassifierOutput
            logits = logits.logits
        return nn.functional.cross_entropy(logits.float(), labels)


class TokenLoss(nn.Module):
    """A language model whose ``forward(tokens)`` returns its loss: an HF causal LM's, or the recipe GPT's."""

    def __init__(self, model: nn.Module, hf: bool):
        super().__init__()
        self.model, self.hf = model, hf

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.hf:
            return self.model(input_ids=tokens, labels=tokens).loss
        return self.model(tokens[:, :-1], tokens[:, 1:])[1]


def build_model(name: str, smoke: bool) -> Tuple[nn.Module, str, int]:
    """The model (random weights, dropout off so every variant computes the same losses), where it comes from,
    and its number of classes or vocabulary size."""
    import transformers

    if name in ("llama", "llama_default"):
        sizes = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16)
        sizes |= dict(num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
        if smoke:
            sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
            sizes |= dict(num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
        config = transformers.LlamaConfig(**sizes, **({"use_cache": False} if name == "llama" else {}))
        return transformers.LlamaForCausalLM(config), "transformers LlamaForCausalLM", config.vocab_size
    if name == "gpt2":
        sizes = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
        if smoke:
            sizes = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64)
        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        config = transformers.GPT2Config(**sizes, **no_dropout, use_cache=False)
        return transformers.GPT2LMHeadModel(config), "transformers GPT2LMHeadModel", config.vocab_size
    if name == "t5_base":
        sizes = dict(d_model=768, d_ff=3072, d_kv=64, num_layers=12, num_decoder_layers=12, num_heads=12)
        if smoke:
            sizes = dict(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=256)
        # t5-base's config also sets the decoder's start token (transformers' T5Config has none by default)
        config = transformers.T5Config(**sizes, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
        model = transformers.T5ForConditionalGeneration(config)
        return model, "transformers T5ForConditionalGeneration", config.vocab_size
    if name == "bart_base":
        sizes = dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12)
        sizes |= dict(decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)
        if smoke:
            sizes = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2)
            sizes |= dict(decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=256)
        # facebook/bart-base's shape (BartConfig's defaults are bart-large's)
        no_dropout = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        config = transformers.BartConfig(**sizes, **no_dropout)
        model = transformers.BartForConditionalGeneration(config)
        return model, "transformers BartForConditionalGeneration", config.vocab_size
    return vision_model(name, smoke, 10 if smoke else 1000)


def vision_model(name: str, smoke: bool, classes: int) -> Tuple[nn.Module, str, int]:
    """timm's model where timm is installed (the GPU image), else transformers' of the same shape (CI): its
    ``<prefix>Config`` defaults are ViT-B/16, ResNet-50 and ConvNeXt-T; its ViT has no stochastic depth, BEiT has."""
    import transformers

    hf_vit = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    hf_vit |= dict(intermediate_size=64)
    hf_resnet = dict(embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2])
    convnext = dict(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 2, 1])
    # name: timm's model and its tiny sizes, transformers' prefix and its tiny sizes, what both add
    timm_name, timm_tiny, prefix, tiny, extra = {
        "vit": ("vit_base_patch16_224", TIMM_VIT_TINY, "ViT", hf_vit, {}),
        "vit_drop_path": ("vit_base_patch16_224", TIMM_VIT_TINY, "Beit", hf_vit, dict(drop_path_rate=0.1)),
        "resnet50": ("resnet50", dict(layers=(2, 2, 2, 2)), "ResNet", hf_resnet, {}),
        "convnext_tiny": ("convnext_tiny", dict(depths=(1, 1, 2, 1), dims=(8, 16, 32, 64)), "ConvNext", convnext, {}),
    }[name]
    if has_module("timm"):
        import timm

        tiny = timm_tiny if smoke else {}
        net = timm.create_model(timm_name, pretrained=False, num_classes=classes, **tiny, **extra)
        return WithLoss(net), f"timm {timm_name}" + (" drop_path_rate=0.1" if extra else ""), classes
    extra |= dict(layer_type="bottleneck") if prefix == "ResNet" else {}
    config = getattr(transformers, f"{prefix}Config")(**(tiny if smoke else {}), **extra, num_labels=classes)
    model = getattr(transformers, f"{prefix}ForImageClassification")(config)
    return WithLoss(model), f"transformers {prefix}ForImageClassification", classes


def count_flops(model: nn.Module, loss: Callable[[], torch.Tensor], device: torch.device) -> int:
    """FLOPs of one eager forward and backward of ``loss()`` (matmuls, convolutions, attention; bf16 autocast on a
    GPU), counted once; grouped-query attention with the library's formulas (torch < 2.13's assert equal heads)."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    formulas = grouped_query_attention_formulas(flop_registry)
    for formula in formulas.values():
        formula._get_raw = True  # type: ignore[attr-defined]  # called with the op's arguments, not their shapes
    counter = FlopCounterMode(display=False, custom_mapping=formulas)
    with counter, torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()
