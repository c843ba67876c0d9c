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


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_chat_finetune_from_an_exported_directory_through_the_cli(tmp_path, capsys):
    """bench/finetune_e2e.py in seconds: a GPT-2 directory written by tierlm's export, its
    tokenizer carrying its own chat template, fine-tuned for 3 steps by `tierlm train` on chat
    records (assistant tokens, documents packing, the tiered runtime); the run's export loads
    in transformers, keeps the template and answers a prompt rendered by it."""
    import json

    from transformers import AutoTokenizer

    from tierlm.cli import main
    from tierlm.models import export_hf

    chats = [{"messages": [{"role": "user", "content": f"What is {i} and {i}?"},
                           {"role": "assistant", "content": f"{i} and {i} is {2 * i}."}]}
             for i in range(40)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    texts = [m["content"] for c in chats for m in c["messages"]]
    tok = train_bpe_tokenizer(texts + ["<|user|> <|assistant|>"], vocab_size=300)
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_configs(vocab_size=300)["gpt2"],
                                             attn_implementation="sdpa")
    src = export_hf(model, tok, tmp_path / "pretrained")
    run = tmp_path / "run"
    assert main(["train", "--model", str(src), "--data", str(data), "--data.packing",
                 "documents", "--offload-policy", "host", "--seq-len", "32", "--batch-size",
                 "2", "--max-steps", "3", "--lr", "1e-2", "--eval-every", "0",
                 "--train.eval_batches", "2", "--train.sample_tokens", "0", "--out", str(run),
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    # the start-of-run summary: schema, mask, template, packing and a rendered example
    assert ("chat, training on assistant tokens; template: the tokenizer's chat template; "
            "packing documents") in out
    assert "[[0 and 0 is 0.<|endoftext|>\n]]" in out
    evals = [r["eval_loss"] for r in map(json.loads, (run / "metrics.jsonl").open())
             if "eval_loss" in r]
    assert len(evals) >= 2 and evals[-1] < evals[0]  # held-out assistant loss fell

    tuned = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    exported = AutoTokenizer.from_pretrained(run / "hf")
    assert exported.chat_template == CHAT_TEMPLATE
    before = dict(model.named_parameters())
    assert any(not torch.equal(p, before[n]) for n, p in tuned.named_parameters())
    prompt = exported.apply_chat_template([{"role": "user", "content": "What is 3 and 3?"}],
                                          tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>\nWhat is 3 and 3?<|endoftext|>\n<|assistant|>\n"
    ids = torch.tensor([exported(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        gen = tuned.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=4, do_sample=False,
                             pad_token_id=exported.eos_token_id)
    assert gen.shape[1] > ids.shape[1]
