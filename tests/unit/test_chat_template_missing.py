"""A base model (no chat template, e.g. Gemma 3 270M) asked for a chat: one clear line, in Python and as the
server's 400 naming `messages`."""
import pytest

from tdpipe.tokenizer import NoChatTemplate, chat_prompt


class _NoTemplate:
    chat_template = None

    def apply_chat_template(self, *a, **k):  # transformers' own error, a paragraph
        raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set and no "
                         "template argument was passed! For information about writing templates ...")


def test_chat_prompt_without_a_template_is_one_line():
    with pytest.raises(NoChatTemplate, match="no chat template .* send plain prompts"):
        chat_prompt(_NoTemplate(), [{"role": "user", "content": "hi"}])


def test_server_answers_400_naming_messages():
    from tdpipe.entrypoints.openai.serving_chat import apply_template

    with pytest.raises(Exception) as e:
        apply_template(_NoTemplate(), [{"role": "user", "content": "hi"}], True, False)
    text = str(getattr(e.value, "detail", e.value)) + repr(e.value)
    assert "no chat template" in text and "rejected" not in text
