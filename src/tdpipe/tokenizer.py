"""Tokenizer access and detokenisation; Hugging Face tokenizers do the work."""
from __future__ import annotations

import re
import threading
from concurrent.futures import Future
from typing import Any

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """Where `text` holds an unpaired UTF-16 surrogate (U+D800-U+DFFF, left by a JSON or Python escape
    without its pair), or None. Such a str is not Unicode text: tokenizers refuse it with a TypeError and it
    cannot be encoded as UTF-8, so every frontend refuses it first, naming where."""
    m = _LONE_SURROGATE.search(text)
    return None if m is None else m.start()


def require_unicode(text: str, what: str) -> str:
    """`text`, or a ValueError saying `what` holds an unpaired surrogate and where (the tokenizer's own error,
    a TypeError about TextEncodeInput, does not say so)."""
    at = lone_surrogate(text)
    if at is not None:
        raise ValueError(f"{what}: character {at} is an unpaired UTF-16 surrogate (U+{ord(text[at]):04X}), "
                         "which is not Unicode text")
    return text


def load_tokenizer(path: str) -> Any:
    """The folder's Hugging Face tokenizer. A missing or damaged tokenizer is a ModelFileError naming the
    folder (one line in the CLI), never a transformers traceback."""
    from transformers import AutoTokenizer

    from tdpipe.model.weights import ModelFileError, check_tokenizer_files  # torch: only where it loads

    check_tokenizer_files(path)
    try:
        return AutoTokenizer.from_pretrained(path, config=_light_config(path))
    except Exception as e:  # noqa: BLE001 - transformers/tokenizers raise many types for a bad file
        msg = (" ".join(str(e).split()) or type(e).__name__)[:300]
        raise ModelFileError(f"cannot load the tokenizer in {path} (damaged tokenizer files?): {msg}") from None


def load_tokenizer_in_background(path: str) -> Future:
    """load_tokenizer(path) on a daemon thread (exit never waits for it), as a future whose result() is the
    tokenizer or raises what loading raised. Importing transformers is most of a tokenizer's 1.4 s here; the
    engine builds its model or starts its stage processes meanwhile, and joins before it needs the eos ids."""
    fut: Future = Future()

    def work() -> None:
        try:
            fut.set_result(load_tokenizer(path))
        except BaseException as e:  # noqa: BLE001 - handed to the joining thread, raised there
            fut.set_exception(e)

    threading.Thread(target=work, name="tdpipe-tokenizer", daemon=True).start()
    return fut


def _light_config(path: str) -> Any:
    """What AutoTokenizer reads from the model's config (its model_type, a tokenizer_class), without
    AutoConfig: that imports the model family's config module and, through it, half of transformers' modelling
    code (0.5 s of every engine start-up here, for a tokenizer that comes out the same). None: let
    AutoTokenizer read the config itself."""
    import json
    import os

    from transformers.configuration_utils import PreTrainedConfig

    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(hf, dict) or "auto_map" in hf:  # remote code decides for itself
        return None
    cfg = PreTrainedConfig()
    cfg.model_type = hf.get("model_type", "")
    if hf.get("tokenizer_class"):
        cfg.tokenizer_class = hf["tokenizer_class"]
    return cfg


class NoChatTemplate(ValueError):
    """The tokenizer has no chat template, so a conversation cannot become a prompt."""


# apply_chat_template's own arguments: chat_template_kwargs may not set them (they would change what the
# call returns, or clash with the flags tdpipe passes itself)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template",
    "tools", "documents", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """vLLM's chat_template_kwargs (variables the template reads, such as Qwen3's enable_thinking): a dict with
    string keys, none of apply_chat_template's own arguments; ValueError naming the problem."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must be a dict with string keys, got {type(kwargs).__name__}")
    bad = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if bad:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, bad))}: "
                         "apply_chat_template's own arguments")
    return dict(kwargs)


def chat_prompt(tokenizer: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None, chat_template: str | None = None
                ) -> tuple[str, list[int]]:
    """A conversation through the model's chat template: the prompt text and its token ids (the template
    carries the special tokens, so none are added again). `continue_final_message` leaves the last message
    open (no end-of-turn after it), so the model goes on with it: a prefilled start of the answer (vLLM's and
    transformers' name); it excludes add_generation_prompt. `template_kwargs`: more variables for the
    template (check_template_kwargs); `tools`: OpenAI's tool definitions, the template's `tools` variable
    (passed only when given); `chat_template`: a Jinja template used instead of the model's (vLLM's
    keyword). A model without a template (a base model such as Gemma 3 270M) and no `chat_template` raises
    NoChatTemplate, one line, rather than transformers' paragraph."""
    if chat_template is None and getattr(tokenizer, "chat_template", "") is None:  # transformers: None if none
        raise NoChatTemplate("this model has no chat template (a base model): send plain prompts (completions) "
                             "instead of messages")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                         "continues the last message, the second opens a new one")
    extra = {"continue_final_message": True} if continue_final_message else {}  # passed only when asked
    extra.update(check_template_kwargs(template_kwargs))
    if tools is not None:
        extra["tools"] = tools
    if chat_template is not None:
        extra["chat_template"] = chat_template
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra)
    return text, tokenizer.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """The text of a growing output, decoding only a short window per new token (O(1) a step, where decoding
    the whole output every step is O(n)): the text added is decode(window + new) minus decode(window).

    The window starts with the prompt's last tokens, so a tokenizer that drops a word's leading space at the
    start of a decode (SentencePiece) still gets it. A token that ends inside a multi-byte character decodes
    to U+FFFD; its text waits until the character is complete."""

    CONTEXT = 5  # prompt tokens in the first window

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix = 0  # window start
        self.read = len(self.ids)  # tokens before this are in `text`
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; returns the text they completed (may be empty)."""
        self.ids.extend(new_ids)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        delta = now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, old_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends in text added after the first `old_len` characters:
    (its index, the string), or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, old_len - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
