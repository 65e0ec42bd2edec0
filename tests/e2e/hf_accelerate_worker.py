"""Run by tests/e2e/test_integrations_ddp.py under `accelerate launch --cpu --num_processes 2`: the
HuggingFace Trainer with MixupCallback on a padded BERT classifier; every process records the batches
its compute_loss saw (per optimizer step) and rank 0 saves the trained weights."""

import sys

import torch
from fsdp_worker import end_without_finalizing  # (this script's folder is on sys.path under accelerate)
from transformers import Trainer

from mixhook import ManifoldMixup
from mixhook.integrations.transformers import MixupCallback
from tests.integrations.test_integrations_transformers import BERT_LAYERS, arguments, bert, rows


class Recording(MixupCallback):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen, self.step = [], 0

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        self.step = state.global_step

    def compute_loss(self, outputs, labels, num_items_in_batch=None):
        if self._model.training:
            self.seen.append((self.step, labels.clone(), num_items_in_batch.clone()))
        return super().compute_loss(outputs, labels, num_items_in_batch)


class Inputs(Trainer):
    """Records each training micro-batch's inputs beside the callback's labels."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        if model.training:
            recorded.append({k: v.clone() for k, v in inputs.items() if k != "labels"})
        return super().compute_loss(model, inputs, *args, **kwargs)


if __name__ == "__main__":
    out = sys.argv[1]
    recorded: list = []
    model = bert()
    callback = Recording(ManifoldMixup(BERT_LAYERS, alpha=1.0))
    args = arguments(out, ddp_backend="gloo")
    trainer = Inputs(
        model=model, args=args, train_dataset=rows("bert", n=32), callbacks=[callback],
        compute_loss_func=callback.compute_loss,
    )  # fmt: skip
    trainer.train()
    rank = args.process_index
    torch.save({"seen": callback.seen, "inputs": recorded, "world": args.world_size}, f"{out}/rank{rank}.pt")
    if rank == 0:
        torch.save(model.state_dict(), f"{out}/model.pt")
    torch.distributed.barrier()  # (neither rank leaves while the other may still be in its last collective)
    end_without_finalizing()  # (fsdp_worker.py says why: gloo's threads can outlive Python's shutdown)
