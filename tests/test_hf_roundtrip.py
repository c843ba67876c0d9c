"""HF checkpoints in and out through training: load, train 3 steps, export, reload, same logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tierlm.config import from_dict
from tierlm.data import train_bpe_tokenizer
from tierlm.models.testing import tiny_hf_configs
from tierlm.train import Trainer

TEXT = "\n".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog, and the cat sat on mat {i % 7}."
    for i in range(400)
)


@pytest.mark.parametrize("name", ["llama_tied_gqa", "qwen2", "gpt2"])
def test_load_train_export_reload_same_logits(name, tmp_path):
    hf_cfg = tiny_hf_configs(vocab_size=300)[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    src = tmp_path / "src"
    model.save_pretrained(src)
    train_bpe_tokenizer([TEXT], vocab_size=300).save_pretrained(src)
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)

    cfg = from_dict(
        {
            "model": {"path": str(src)},
            "data": {"train": str(data), "seq_len": 32},
            "train": {"max_steps": 3, "batch_size": 2, "eval_batches": 1, "eval_every": 0},
            "optim": {"lr": 1e-2, "warmup_steps": 0},
            "run": {"out": str(tmp_path / "run"), "device": "cpu"},
        }
    )
    trainer = Trainer(cfg, log=lambda _m: None)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training changed nothing"

    from tierlm.models import export_hf

    out = export_hf(trainer.model, trainer.tokenizer, tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    trainer.model.eval()
    x = torch.randint(0, hf_cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, trainer.model(x).logits)  # fp32 in, fp32 out
    assert hf_cfg.tie_word_embeddings  # every tiny config is tied; the export keeps the tie
    assert reloaded.get_input_embeddings().weight is reloaded.get_output_embeddings().weight
