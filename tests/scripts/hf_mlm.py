"""A masked-LM ``Trainer`` script of the usual shape (not the team's own): a tokenizer (built here:
no download), a ``datasets.Dataset`` tokenized with ``map``, ``DataCollatorForLanguageModeling``
(dynamic padding, random masking drawn in the DataLoader's worker processes), a BERT model,
gradient accumulation, warm-up, logging and evaluation.

Usage: hf_mlm.py OUTPUT_DIR STEPS NUM_WORKERS
"""

from __future__ import annotations

import sys

import datasets
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    TrainingArguments,
)

from checkpointless.integrations.transformers import Trainer


def main() -> None:
    out, steps, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    vocab = {
        "[PAD]": 0,
        "[UNK]": 1,
        "[CLS]": 2,
        "[SEP]": 3,
        "[MASK]": 4,
        **{f"w{i}": i + 5 for i in range(120)},
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    g = torch.Generator().manual_seed(3)
    texts = [
        " ".join(
            f"w{int(t)}"
            for t in torch.randint(0, 120, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g)
        )
        for _ in range(200)
    ]
    ds = datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: fast(b["text"], truncation=True, max_length=32), batched=True, remove_columns=["text"]
    )
    split = ds.train_test_split(test_size=0.1, seed=0)
    torch.manual_seed(0)
    model = BertForMaskedLM(
        BertConfig(
            vocab_size=len(vocab),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
    )
    args = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=5e-3,
        warmup_steps=2,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=6,
        save_strategy="no",
        use_cpu=True,
        report_to=[],
        seed=5,
        dataloader_num_workers=workers,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=split["train"],
        eval_dataset=split["test"],
        data_collator=DataCollatorForLanguageModeling(fast, mlm_probability=0.15),
    )
    r = trainer.train()
    print(f"trained {r.global_step} steps, loss {r.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
