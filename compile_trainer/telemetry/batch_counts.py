"""What a batch holds, counted without configuration: samples, images, tokens.

Samples: the leading dimension of the batch's first tensor (Lightning's own rule for ``self.log``), for a tensor, a
tuple, list or mapping of them, nested or not. Images: the samples of a batch whose first tensor is a 4-D floating
point tensor (N x C x H x W: pixels). Tokens (``token_counts``): a mapping with ``input_ids`` (or ``inputs``,
``tokens``) of integer ids, with an ``attention_mask`` saying which are real, or a tuple/list whose first element
is integer ids of shape (batch, length). A count that needs the device (the mask's sum) is copied to the host
without waiting and read once the step is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Tuple, Union

import torch

from compile_trainer.schema.shapes import ROLE_NAMES

Count = Union[int, torch.Tensor]  # a tensor: on the host, filled once the step is done
IMAGE_DIMS = 4  # N x C x H x W


def default_samples(batch: Any) -> int:
    """The leading dimension of the batch's first tensor (Lightning's own rule for ``self.log``)."""
    from lightning.pytorch.utilities.data import extract_batch_size

    return extract_batch_size(batch)


def first_tensor(batch: Any) -> Optional[torch.Tensor]:
    """The batch itself if it is a tensor, else the first tensor of its elements (a mapping's values in order),
    depth first; None where it holds none."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for element in batch:
            if (found := first_tensor(element)) is not None:
                return found
    return None


def is_image_batch(batch: Any) -> bool:
    """Whether the batch's first tensor is pixels: floating point, N x C x H x W."""
    tensor = first_tensor(batch)
    return tensor is not None and tensor.is_floating_point() and tensor.dim() == IMAGE_DIMS


def _token_ids(value: Any) -> Optional[torch.Tensor]:
    integer = isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()
    return value if integer and value.dtype is not torch.bool and value.dim() >= 2 else None


def token_counts(batch: Any) -> Optional[Tuple[Count, int]]:
    """(real tokens, positions) of a batch of token ids, or None where the batch holds none it can tell.

    Real tokens are the attention mask's nonzero entries where the batch has a mask of the ids' shape, else every
    position. On a GPU the real count is a host tensor filled without synchronizing (read it after the step).
    """
    ids, mask = None, None
    if isinstance(batch, Mapping):
        ids = next((found for n in ROLE_NAMES["tokens"] if (found := _token_ids(batch.get(n))) is not None), None)
        mask = next((batch.get(n) for n in ROLE_NAMES["attention_mask"] if n in batch), None)
    elif isinstance(batch, (list, tuple)) and batch:
        ids = _token_ids(batch[0])
    if ids is None:
        return None
    positions = ids.numel()
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        return positions, positions
    real = mask.count_nonzero()
    if real.device.type == "cpu":
        return int(real), positions
    return real.to("cpu", non_blocking=True), positions
