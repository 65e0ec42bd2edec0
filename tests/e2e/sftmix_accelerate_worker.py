"""Run by tests/e2e/test_integrations_ddp.py under `accelerate launch --multi_gpu --num_processes 2` (CPU,
gloo): the HuggingFace Trainer with SFTMixLoss and PairedBatches (SFTMix in a HookCallback) on a tiny Llama,
two micro-batches a step, trained six steps over two epochs with a checkpoint after step 4 (mid-way through
the second); then a second trainer resumes from that checkpoint. Every process records the micro-batches
each run's compute_loss saw (per optimizer step); rank 0 saves both runs' weights."""

import sys

import datasets
import torch
import transformers
from fsdp_worker import end_without_finalizing  # (this script's folder is on sys.path under accelerate)

from harness.matrix.language import CONFIDENT, data, model
from mixhook import SFTMix
from mixhook.integrations.lm import PairedBatches, SFTMixLoss
from mixhook.integrations.transformers import HookCallback

ROWS = 48  # 12 paired batches of 4 an epoch: 3 steps of 2 processes x 2 micro-batches


class Recording(HookCallback):
    step = 0

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        self.step = state.global_step


class Trainer(SFTMixLoss, PairedBatches, transformers.Trainer):
    """Records each training micro-batch with its optimizer step."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        if model.training:
            step = next(c for c in self.callback_handler.callbacks if isinstance(c, Recording)).step
            seen.append((step, {k: v.clone() for k, v in inputs.items()}))
        return super().compute_loss(model, inputs, *args, **kwargs)


def table():
    rows, flags = data(ROWS)
    return datasets.Dataset.from_dict({**{k: v.tolist() for k, v in rows.items()}, CONFIDENT: flags})


def arguments(out: str) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=6,
        optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0, weight_decay=0.0,
        report_to=[], save_strategy="steps", save_steps=4, save_only_model=False, use_cpu=True, seed=7,
        logging_strategy="no", disable_tqdm=True, ddp_backend="gloo", per_device_eval_batch_size=5,
    )  # fmt: skip


def trainer(out: str) -> Trainer:
    return Trainer(
        model=model(), args=arguments(out), train_dataset=table(), callbacks=[Recording(SFTMix("model.norm"))]
    )


if __name__ == "__main__":
    out = sys.argv[1]
    seen: list = []
    first = trainer(f"{out}/run")
    first.train()
    whole, seen = seen, []
    second = trainer(f"{out}/run")  # (the same output directory: its checkpoint-4)
    second.train(resume_from_checkpoint=f"{out}/run/checkpoint-4")
    # the evaluation loss over both processes' batches (odd ones too), as the Trainer's own loss gives it
    odd = table().select(range(13))
    losses = {
        "sftmix": first.evaluate(eval_dataset=odd)["eval_loss"],
        "plain": transformers.Trainer(model=first.model, args=arguments(f"{out}/plain")).evaluate(odd)[
            "eval_loss"
        ],
    }
    rank = first.args.process_index
    record = {"whole": whole, "resumed": seen, "world": first.args.world_size, "eval": losses}
    torch.save(record, f"{out}/rank{rank}.pt")
    if rank == 0:
        torch.save(
            {"whole": first.model.state_dict(), "resumed": second.model.state_dict()}, f"{out}/models.pt"
        )
    torch.distributed.barrier()  # (neither rank leaves while the other may still be in its last collective)
    end_without_finalizing()  # (fsdp_worker.py says why: gloo's threads can outlive Python's shutdown)
