"""vLLM's bad_words and truncate_prompt_tokens without a model: how words become token sequences, which
token each bans given the answer so far, and the checks of both fields."""
import pytest

from tdpipe import SamplingParams
from tdpipe.core.validation import MAX_BAD_WORDS, RequestError, check_bad_words, truncated
from tdpipe.sampling.bad_words import bad_word_bans, bad_words_token_ids
from tdpipe.sampling.metadata import SamplingMetadata

# a toy BPE: a word alone and after a space are different tokens, "new york" is two
VOCAB = {"cat": [1], " cat": [2], "new york": [3, 4], " new york": [5, 4], "dog": [6, 7], " dog": [8]}


def test_words_become_their_bare_and_spaced_spellings():
    assert bad_words_token_ids(["cat"], VOCAB.__getitem__) == [[1], [2]]
    assert bad_words_token_ids(["  new york"], VOCAB.__getitem__) == [[3, 4], [5, 4]]  # leading spaces stripped
    # the spaced spelling is kept only when it has as many tokens as the bare one (vLLM's rule)
    assert bad_words_token_ids(["dog"], VOCAB.__getitem__) == [[6, 7]]


def test_a_word_bans_its_next_token_only_while_the_answer_spells_it():
    seqs = [[1], [3, 4], [9, 3, 4]]
    assert bad_word_bans(seqs, []) == [1]  # one token: always
    assert bad_word_bans(seqs, [7, 3]) == [1, 4]  # "new" just written: not "york"
    assert bad_word_bans(seqs, [9, 3]) == [1, 4, 4]
    assert bad_word_bans(seqs, [3, 7]) == [1]


def test_metadata_bans_bad_words_beside_min_tokens():
    class Seq:
        def __init__(self, params, out):
            self.sampling_params, self.output_token_ids, self.prompt_token_ids = params, out, [0]

    p = SamplingParams(bad_words=["new york"], min_tokens=3, stop_token_ids=[11])
    p.bad_words_token_ids = [[3, 4]]
    meta = SamplingMetadata.from_samples([(Seq(p, [3]), 0), (Seq(p, [5, 6, 7]), 0)], eos_token_ids=[2])
    assert meta.banned == [[2, 11, 4], []]
    assert p.needs_processing  # such a row needs its logits: no argmax on the last stage


@pytest.mark.parametrize("kw, field", [({"bad_words": "cat"}, "bad_words"), ({"bad_words": ["ok", " "]}, "bad_words"),
                                       ({"bad_words": [3]}, "bad_words"), ({"truncate_prompt_tokens": 0}, "truncate"),
                                       ({"truncate_prompt_tokens": -2}, "truncate"),
                                       ({"truncate_prompt_tokens": 2.0}, "truncate")])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_empty_bad_words_mean_none():
    assert SamplingParams(bad_words=[]).bad_words is None and not SamplingParams(bad_words=[]).needs_processing


def test_truncation_keeps_the_prompts_end():
    ids = list(range(10))
    assert truncated(ids, SamplingParams(truncate_prompt_tokens=3), 100) == [7, 8, 9]
    assert truncated(ids, SamplingParams(truncate_prompt_tokens=30), 100) == ids
    assert truncated(ids, SamplingParams(), 5) == ids  # not asked: the length check refuses it later
    assert truncated(ids, SamplingParams(truncate_prompt_tokens=-1), 5) == [6, 7, 8, 9]  # room for one token
    with pytest.raises(RequestError, match="greater than max_model_len") as e:
        truncated(ids, SamplingParams(truncate_prompt_tokens=6), 5)
    assert e.value.param == "truncate_prompt_tokens"


def test_bad_word_caps():
    check_bad_words(["x"] * MAX_BAD_WORDS)
    for words in (["x"] * (MAX_BAD_WORDS + 1), ["x" * 1000]):
        with pytest.raises(RequestError) as e:
            check_bad_words(words)
        assert e.value.param == "bad_words"
