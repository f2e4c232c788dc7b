"""vLLM's chat_template_kwargs: variables a chat template reads (Qwen3's enable_thinking) reach it, in Python
and through the server's helpers; apply_chat_template's own arguments cannot be set through them."""
import jinja2
import pytest

from tdpipe.tokenizer import RESERVED_TEMPLATE_KWARGS, chat_prompt, check_template_kwargs

TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
CONV = [{"role": "user", "content": "hi"}]


class _Tok:
    """A tokenizer with a jinja chat template, rendering as transformers does (the variables as keywords)."""

    chat_template = TEMPLATE

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=False, **kwargs):
        assert tokenize is False
        return jinja2.Template(self.chat_template).render(messages=conversation,
                                                          add_generation_prompt=add_generation_prompt, **kwargs)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_template_variables_reach_the_template():
    text, ids = chat_prompt(_Tok(), CONV, template_kwargs={"enable_thinking": False})
    assert text == "<no-think>user: hi\nassistant:" and ids == [ord(c) for c in text]
    assert chat_prompt(_Tok(), CONV, template_kwargs={"enable_thinking": True})[0] == "user: hi\nassistant:"
    assert chat_prompt(_Tok(), CONV)[0] == "user: hi\nassistant:"


@pytest.mark.parametrize("bad, match", [({"tokenize": True}, "'tokenize'"), ({"add_generation_prompt": False},
                                        "add_generation_prompt"), ([("a", 1)], "dict"), ({1: True}, "string keys")])
def test_bad_kwargs_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        check_template_kwargs(bad)
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        chat_prompt(_Tok(), CONV, template_kwargs=bad)


def test_the_server_answers_400_naming_the_field():
    from tdpipe.entrypoints.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=CONV, chat_template_kwargs={"tokenize": True})
    with pytest.raises(Exception) as e:
        req.template_kwargs()
    assert "chat_template_kwargs" in repr(e.value) + str(getattr(e.value, "detail", ""))
    assert "tokenize" in RESERVED_TEMPLATE_KWARGS
