"""Models nobody here wrote, from configs with random weights (nothing is downloaded), in a LightningModule.

Hugging Face transformers' Llama, GPT-2, BERT, T5 and BART (encoder-decoders), ViT and ResNet, a torchvision-style
ResNet-18 (the staged CNN timm and torchvision build: BasicBlocks in four stages of widths 64..512 scaled down, a
downsampling block opening stages 2-4) and timm's VisionTransformer (``TimmViT``), rebuilt here because timm and
torchvision cannot be installed beside the CPU torch (timm imports torchvision).
"""

from typing import Callable, Dict

import lightning.pytorch as pl
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader

VOCAB, LENGTH, IMAGE = 96, 16, 32


def tiny_llama(**overrides) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **overrides,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2(**overrides) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, **overrides,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def gpt2_attention_of_transformers_4(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
    """``GPT2Attention._attn`` of transformers 4.x (4.46) as an attention function of today's transformers: with
    ``scale_attn_by_inverse_layer_idx`` it divides by ``float(self.layer_idx + 1)`` in every forward (5.x folds that
    into the float ``scaling`` at init). The causal mask, which 4.x kept as a buffer, is built here."""
    attn_weights = torch.matmul(query, key.transpose(-1, -2))
    if module.scale_attn_weights:
        attn_weights = attn_weights / torch.full(
            [], value.size(-1) ** 0.5, dtype=attn_weights.dtype, device=attn_weights.device
        )
    if module.scale_attn_by_inverse_layer_idx:
        attn_weights = attn_weights / float(module.layer_idx + 1)
    length = query.size(-2)
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    attn_weights = attn_weights.masked_fill(~causal, torch.finfo(attn_weights.dtype).min)
    if attention_mask is not None:  # today's transformers hands this function SDPA's boolean mask, or None
        attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
    attn_weights = nn.functional.dropout(
        nn.functional.softmax(attn_weights, dim=-1), p=dropout, training=module.training
    )
    return torch.matmul(attn_weights, value).transpose(1, 2), attn_weights


transformers.AttentionInterface.register("gpt2_of_transformers_4", gpt2_attention_of_transformers_4)


def tiny_bert(**overrides) -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def tiny_t5(**overrides) -> nn.Module:
    config = dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(transformers.T5Config(**(config | overrides)))


def tiny_bart(**overrides) -> nn.Module:
    """BART, the encoder-decoder that mBART, Marian, Pegasus and Whisper's text side are built like: learned
    positions, and forwards wrapped by transformers' decorators."""
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, **overrides,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


def tiny_vit(**overrides) -> nn.Module:
    config = transformers.ViTConfig(
        image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=64, num_labels=10, **overrides,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def tiny_convnext(**overrides) -> nn.Module:
    """ConvNeXt-T's layout (stages of 3, 3, 9 and 3 blocks, each stage wider), widths scaled down."""
    config = transformers.ConvNextConfig(
        num_channels=3, hidden_sizes=[8, 16, 32, 64], depths=[3, 3, 9, 3], num_labels=10, **overrides
    )
    return transformers.ConvNextForImageClassification(config)


def tiny_beit(**overrides) -> nn.Module:
    """BEiT: a ViT whose blocks carry stochastic depth rising linearly to ``drop_path_rate`` (timm's recipe)."""
    config = dict(
        image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
        intermediate_size=64, num_labels=10, drop_path_rate=0.1,
    )  # fmt: skip
    return transformers.BeitForImageClassification(transformers.BeitConfig(**(config | overrides)))


def tiny_swin(**overrides) -> nn.Module:
    """Swin: hierarchical stages whose blocks alternate plain and shifted windows (``shift_size``), stochastic depth
    rising to the config's default ``drop_path_rate`` 0.1."""
    config = dict(
        image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 6], num_heads=[2, 4], window_size=4,
        num_labels=10,
    )  # fmt: skip
    return transformers.SwinForImageClassification(transformers.SwinConfig(**(config | overrides)))


def tiny_hf_resnet(**overrides) -> nn.Module:
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[2, 2, 2, 2], layer_type="basic", num_labels=10,
        **overrides,
    )  # fmt: skip
    return transformers.ResNetForImageClassification(config)


class BasicBlock(nn.Module):
    """torchvision's / timm's ResNet BasicBlock."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + shortcut)


class StagedResNet(nn.Module):
    """torchvision's resnet18 layout (stem, layer1..layer4 of two BasicBlocks, pool, fc), widths scaled down."""

    def __init__(self, widths=(8, 16, 32, 64), num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes = widths[0]
        for index, planes in enumerate(widths):
            stride = 1 if index == 0 else 2
            self.add_module(
                f"layer{index + 1}", nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes))
            )
            inplanes = planes
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(pixel_values))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        logits = self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
        return nn.functional.cross_entropy(logits, labels)


def timm_drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    """timm.layers.drop.drop_path (timm 1.0.31) as published: its ``bernoulli_`` takes the probability as a float,
    which the compiler bakes into the graph."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class TimmDropPath(nn.Module):
    """timm.layers.drop.DropPath."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob, self.scale_by_keep = drop_prob, True

    def forward(self, x):
        return timm_drop_path(x, self.drop_prob, self.training, self.scale_by_keep)


class TimmAttention(nn.Module):
    """timm's ``Attention``: one qkv projection, (identity) q/k norms, fused attention, an output projection."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        qkv = self.qkv(x).reshape(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = nn.functional.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v)
        return self.proj(x.transpose(1, 2).reshape(batch, length, dim))


class TimmBlock(nn.Module):
    """timm's ViT ``Block``: pre-norm attention and MLP, each with (identity) layer scale and drop path (an identity
    where the block's rate is 0, as timm builds it)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int = 4, drop_path: float = 0.0):
        super().__init__()
        self.norm1, self.attn, self.ls1 = nn.LayerNorm(dim), TimmAttention(dim, num_heads), nn.Identity()
        self.drop_path1 = TimmDropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2, self.ls2 = nn.LayerNorm(dim), nn.Identity()
        self.drop_path2 = TimmDropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class TimmViT(nn.Module):
    """timm's ``VisionTransformer`` (vit_*_patch*): conv patch embedding, class token, learned position embedding,
    blocks in an ``nn.Sequential`` (stochastic depth rising linearly from 0 to ``drop_path_rate``, timm's rule),
    final norm, class-token pooling, linear head; returns logits."""

    def __init__(
        self, image: int = IMAGE, patch: int = 8, dim: int = 32, depth: int = 3, heads: int = 4, classes: int = 10,
        drop_path_rate: float = 0.0,
    ):  # fmt: skip
        super().__init__()
        rates = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]  # timm's dpr
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(TimmBlock(dim, heads, drop_path=rate) for rate in rates))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def token_batches(count: int, seed: int, mask_labels: bool = False):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (4, LENGTH), generator=generator)
        labels = ids.clone()
        if mask_labels:  # masked LM: the loss on a few positions only
            labels[torch.rand(ids.shape, generator=generator) < 0.7] = -100
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return batches


def image_batches(count: int, seed: int, size: int = IMAGE):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        pixels = torch.randn(4, 3, size, size, generator=generator)
        batches.append({"pixel_values": pixels, "labels": torch.randint(0, 10, (4,), generator=generator)})
    return batches


FAMILIES: Dict[str, Callable] = {
    "llama": lambda seed: token_batches(4, seed),
    "gpt2": lambda seed: token_batches(4, seed),
    "bert": lambda seed: token_batches(4, seed, mask_labels=True),
    "t5": lambda seed: token_batches(4, seed),
    "bart": lambda seed: token_batches(4, seed),
    "vit": lambda seed: image_batches(4, seed),
    "hf_resnet": lambda seed: image_batches(4, seed),
    "convnext": lambda seed: image_batches(4, seed, size=64),  # 2x2 in the last stage, as 7x7 at 224
    "beit": lambda seed: image_batches(4, seed),
    "swin": lambda seed: image_batches(4, seed),
    "staged_resnet": lambda seed: image_batches(4, seed),
}
BUILDERS: Dict[str, Callable[..., nn.Module]] = {
    "llama": tiny_llama,
    "gpt2": tiny_gpt2,
    "bert": tiny_bert,
    "t5": tiny_t5,
    "bart": tiny_bart,
    "vit": tiny_vit,
    "hf_resnet": tiny_hf_resnet,
    "convnext": tiny_convnext,
    "beit": tiny_beit,
    "swin": tiny_swin,
    "staged_resnet": StagedResNet,
}


class UserModule(pl.LightningModule):
    """A LightningModule as users write one around a model: the loss comes from the model (``labels=``)."""

    def __init__(self, family: str, **config):
        super().__init__()
        self.family = family
        torch.manual_seed(0)
        self.model = BUILDERS[family](**config)
        self.losses = []

    def step(self, batch):
        output = self.model(**batch)
        return output if isinstance(output, torch.Tensor) else output.loss

    def training_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):
        return self.step(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class UserData(pl.LightningDataModule):
    def __init__(self, family: str):
        super().__init__()
        self.train, self.val = FAMILIES[family](1), FAMILIES[family](2)[:1]

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=None)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=None)


class SimpleDenseNet(nn.Module):
    """lightning-hydra-template's MNIST model (src/models/components/simple_dense_net.py): no repeated blocks."""

    def __init__(self, input_size: int = 64, lin1_size: int = 32, lin2_size: int = 32, lin3_size: int = 32,
                 output_size: int = 10):  # fmt: skip
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, lin1_size),
            nn.BatchNorm1d(lin1_size),
            nn.ReLU(),
            nn.Linear(lin1_size, lin2_size),
            nn.BatchNorm1d(lin2_size),
            nn.ReLU(),
            nn.Linear(lin2_size, lin3_size),
            nn.BatchNorm1d(lin3_size),
            nn.ReLU(),
            nn.Linear(lin3_size, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, channels, width, height = x.size()
        x = x.view(batch_size, -1)
        return self.model(x)


class MNISTLitModule(pl.LightningModule):
    """lightning-hydra-template's MNISTLitModule (src/models/mnist_module.py), trimmed to what a fit runs: the net,
    its loss and the torchmetrics it logs."""

    def __init__(self):
        super().__init__()
        from torchmetrics import MaxMetric, MeanMetric
        from torchmetrics.classification.accuracy import Accuracy

        torch.manual_seed(0)
        self.net = SimpleDenseNet()
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc, self.val_acc = (
            Accuracy(task="multiclass", num_classes=10),
            Accuracy("multiclass", num_classes=10),
        )
        self.train_loss, self.val_loss = MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()
        self.losses = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model_step(self, batch):
        x, y = batch
        logits = self.forward(x)
        return self.criterion(logits, y), logits.argmax(dim=1), y

    def training_step(self, batch, batch_idx):
        loss, preds, targets = self.model_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def digit_batches(count: int, seed: int):
    """MNIST-shaped batches (8x8 images here), as ``(x, y)`` tuples."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 1, 8, 8, generator=generator), torch.randint(0, 10, (8,), generator=generator))
            for _ in range(count)]  # fmt: skip
