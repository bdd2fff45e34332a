"""A Hugging Face causal LM in a plain LightningModule, trained with compile_trainer's callback and nothing else.

The model is built from its config's defaults (``use_cache=True``, as ``from_pretrained`` gives it; random weights,
nothing is downloaded). The text is the Python standard library's source, byte-level, one paragraph per row, in
batches padded to their longest row as a DataCollator pads them (``attention_mask``, ``labels`` -100 on padding).
The callback prints its plan when fit starts, and at the end what compiled, the throughput in real tokens/s (from
the attention mask) and, on a GPU, MFU.

    python docs/examples/hf_causal_lm.py                     # CPU: the `dynamic` policy, Inductor
    python docs/examples/hf_causal_lm.py --policy none       # the eager baseline, with the same telemetry
    python docs/examples/hf_causal_lm.py --policy dynamic_full --precision bf16-mixed --steps 300 \
        --layers 16 --hidden 1024 --heads 16 --max-length 1024    # a GPU: one graph, lengths padded to 64s

Rows of varying length are what ``dynamic`` is for: the blocks compile once, dynamic in batch size and length,
where ``regional`` would compile again at the second length (then Dynamo makes it dynamic itself). Validation runs
the model as Hugging Face does in evaluation, building a KV cache: a graph per layer (docs/policies.md).
"""

import argparse
from typing import Dict, List

import lightning.pytorch as pl
import torch
import transformers
from torch.utils.data import DataLoader

from compile_trainer import CompileCallback
from compile_trainer_recipes.data import read_stdlib_bytes, split_paragraphs


class CausalLM(pl.LightningModule):
    def __init__(self, layers: int, hidden: int, heads: int, max_length: int, lr: float = 1e-3):
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=max_length,
            pad_token_id=0,
        )  # fmt: skip
        self.model = transformers.LlamaForCausalLM(config)
        self.lr = lr

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.model(**batch).loss)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        schedule = transformers.get_cosine_schedule_with_warmup(optimizer, 10, self.trainer.estimated_stepping_batches)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def pad_to_longest(rows: List[bytes]) -> Dict[str, torch.Tensor]:
    """What ``DataCollatorForLanguageModeling(mlm=False)`` makes: ids padded with 0, a mask, labels -100 on padding."""
    length = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.frombuffer(bytearray(row), dtype=torch.uint8)
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loaders(batch_size: int, max_length: int, text_bytes: int):
    texts = read_stdlib_bytes(text_bytes)
    rows = [p for text in texts for p in split_paragraphs(text, 32, max_length)]
    split = batch_size * max(1, len(rows) // 20 // batch_size)  # whole batches: a smaller one compiles again
    train = DataLoader(rows[split:], batch_size, shuffle=True, collate_fn=pad_to_longest, drop_last=True)
    return train, DataLoader(rows[:split], batch_size, collate_fn=pad_to_longest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="dynamic", help="a bundled policy (conf/compile/) or a YAML file")
    parser.add_argument("--backend", default=None, help="e.g. eager or aot_eager to check the plan in seconds")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--text-bytes", type=int, default=4_000_000)
    parser.add_argument("--precision", default="32-true", help="Lightning's: 32-true, bf16-mixed, 16-mixed")
    parser.add_argument("--out", default="outputs/examples/hf_causal_lm")
    args = parser.parse_args()

    pl.seed_everything(0)
    model = CausalLM(args.layers, args.hidden, args.heads, args.max_length)
    train, val = loaders(args.batch_size, args.max_length, args.text_bytes)
    overrides = {"backend": args.backend} if args.backend else {}
    callback = CompileCallback(args.policy, **overrides)
    trainer = pl.Trainer(
        max_steps=args.steps, precision=args.precision, callbacks=[callback], default_root_dir=args.out,
        val_check_interval=min(100, args.steps), check_val_every_n_epoch=None, limit_val_batches=10,
        log_every_n_steps=10,
    )  # fmt: skip
    trainer.fit(model, train, val)
    summary = callback.summary()
    print(
        f"train/loss {float(trainer.callback_metrics['train/loss']):.3f}, "
        f"val/loss {float(trainer.callback_metrics['val/loss']):.3f}; first step {summary['first_step_time_s']:.1f} s, "
        f"{summary['recompiles']} recompiles, {summary['graph_breaks']} graph breaks"
    )


if __name__ == "__main__":
    main()
