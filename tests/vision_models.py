"""timm's vision families as their training recipes build them (their usual stochastic depth), at tiny widths and
image sizes for the CPU, random weights (``pretrained=False``: nothing downloaded), inside a plain LightningModule fed
``(images, labels)`` tuples. Used by tests/test_vision_models.py (the tier ``vision``: timm is needed, and a
missing timm fails these tests rather than skipping them). timm is imported when a model is built, not with this
module: the README's suite, which leaves the tier out, still collects its files, where timm may not import."""

from typing import Any, Dict, List, Tuple

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

CLASSES = 10
# family: (timm model, its keyword arguments, image side). Each keeps its family's block structures: ConvNeXt-T's
# depths (3, 3, 9, 3), Swin-T's (2, 2, 6, 2) with a window that shifts in the third stage and not in the last (its
# resolution equals the window, as at 224 px), EfficientNet-B0 itself, ResNet-50's stages at 1/8 of its widths.
# ConvNeXt at 64 px: at 32 its last stage is 1 x 1, where the first block's input (the downsampling convolution's,
# contiguous) and the others' (channels-last strides) differ only in the strides of size-1 dimensions, and Dynamo's
# guards on them recompile the stage's shared entry once.
FAMILIES: Dict[str, Tuple[str, Dict[str, Any], int]] = {
    "convnext": ("convnext_tiny", dict(dims=(8, 16, 32, 64), drop_path_rate=0.1), 64),
    "swin": (
        "swin_tiny_patch4_window7_224",
        dict(img_size=32, patch_size=2, window_size=2, embed_dim=8, num_heads=(1, 1, 2, 2), drop_path_rate=0.1),
        32,
    ),
    "efficientnet": ("efficientnet_b0", dict(drop_path_rate=0.2), 32),
    "resnet": ("resnet50", dict(channels=(8, 16, 32, 64), stem_width=8), 32),
    "vit": ("vit_base_patch16_224", dict(img_size=16, patch_size=4, embed_dim=32, depth=6, num_heads=2,
                                         drop_path_rate=0.1), 16),
}  # fmt: skip
BATCH, BATCHES = 4, 4


def build(family: str) -> nn.Module:
    import timm  # a missing timm (or torchvision, which it imports) fails the test that builds a model

    name, kwargs, _ = FAMILIES[family]
    return timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)


def drop_paths(net: nn.Module) -> List[nn.Module]:
    return [module for module in net.modules() if type(module).__name__ == "DropPath"]


class Classifier(pl.LightningModule):
    """A plain LightningModule as a user writes one. ``drop_path``: the model's stochastic depth trains (as its
    recipe trains it); without it its ``DropPath`` modules run in evaluation mode (the identity), so that eager and
    compiled training draw no random numbers and their losses can be compared (the plan is the same: it is made
    from the modules, not from their mode)."""

    def __init__(self, family: str, drop_path: bool = True) -> None:
        super().__init__()
        self.net, self.drop_path = build(family), drop_path
        self.losses: List[torch.Tensor] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for module in drop_paths(self.net):
            module.train(self.drop_path)

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self.net(images), labels)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def images(family: str) -> DataLoader:
    """``BATCHES`` distinct ``(images, labels)`` batches, the same on every call."""
    generator, side = torch.Generator().manual_seed(0), FAMILIES[family][2]
    pictures = [torch.randn(BATCH, 3, side, side, generator=generator) for _ in range(BATCHES)]
    data = [(x, torch.randint(0, CLASSES, (BATCH,), generator=generator)) for x in pictures]
    return DataLoader(data, batch_size=None)
