"""A Hugging Face model directory made on the spot, for the HTTP server's tests: a byte-level BPE
tokenizer trained on a few sentences (with a chat template) and a small GPT-2 of random weights
over its vocabulary, saved as ``from_pretrained`` reads them. No network."""

import os

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXT = ["the quick brown fox jumps over the lazy dog", "graphs replay kernels without the host",
        "a shared batch serves many callers at once", "héllo wörld, ünïcode bytes split over tokens: 東京"]


def make(path: str, positions: int = 256, layers: int = 2, seed: int = 0, width: int = 64) -> str:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TEXT * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    tok.chat_template = CHAT
    os.makedirs(path, exist_ok=True)
    tok.save_pretrained(path)
    torch.manual_seed(seed)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = GPT2Config(n_layer=layers, n_head=2, n_embd=width, vocab_size=len(tok), n_positions=positions,
                     bos_token_id=eos, eos_token_id=eos)
    GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    return path
