"""The tiny language models the language-model checks build (nothing downloaded), and TRL's SFTTrainer on
them: the matrix's language rows and the TRL tests train the same ones."""

import torch
from torch import nn

VOCAB = 64  # (the TRL rows' vocabulary: token ``t<i>`` is id ``i``, 0 pads)


def tiny_llama(**config) -> nn.Module:
    """A Llama causal LM built small (vocabulary 64, width 16, 2 layers; ``config`` keys override these) in
    float64, its weights drawn after ``torch.manual_seed(0)``, in train mode."""
    import transformers

    torch.manual_seed(0)
    options = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**options, **config})).double().train()


def tokenizer():
    """A word-level tokenizer built in code (nothing downloaded): token ``t<i>`` is id ``i``, 0 pads."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<pad>": 0} | {f"t{i}": i for i in range(1, VOCAB)}
    model = WordLevel(vocab, unk_token="t1")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(model), pad_token="<pad>", eos_token="t2"
    )


def llama():
    return tiny_llama(vocab_size=VOCAB, max_position_embeddings=64)


def dataset(n=12):
    """Prompt-completion rows of different lengths: the first two tokens are the prompt (no loss)."""
    import datasets

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 9, (), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "completion_mask": [0, 0] + [1] * (length - 2)})
    return datasets.Dataset.from_list(rows)


def sft(model, tmp_path, callbacks, loss=None, cls=None, **options):
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_train_epochs=1, report_to=[],
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, learning_rate=0.1,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0, weight_decay=0.0, seed=7,
        completion_only_loss=True, train_sampling_strategy="sequential",
    )  # fmt: skip
    settings.update(options)
    import trl

    return (cls or trl.SFTTrainer)(
        model=model, args=trl.SFTConfig(**settings), train_dataset=dataset(), processing_class=tokenizer(),
        callbacks=callbacks, compute_loss_func=loss,
    )  # fmt: skip
