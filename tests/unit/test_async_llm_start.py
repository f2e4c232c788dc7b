"""AsyncLLM's start-up without processes: the tokenizer loaded while the engine core starts is used only where
it came from the folder the core loaded; otherwise, or where that early load failed, it is loaded again."""
from __future__ import annotations

import asyncio

import tdpipe.tokenizer
from tdpipe.core.async_llm import AsyncLLM


def test_the_early_tokenizer_is_used_only_from_the_cores_folder(monkeypatch):
    loads: list[str] = []
    monkeypatch.setattr(tdpipe.tokenizer, "load_tokenizer", lambda path: loads.append(path) or f"loaded {path}")

    def broken() -> str:
        raise ValueError("damaged tokenizer.json")

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def early(path: str, fn=lambda: "early") -> tuple[str, asyncio.Future]:
            return path, loop.run_in_executor(None, fn)

        assert await AsyncLLM._tokenizer_of("/m", early("/m")) == "early" and loads == []
        assert await AsyncLLM._tokenizer_of("/m-f32", early("/m")) == "loaded /m-f32"  # the core chose another
        assert await AsyncLLM._tokenizer_of("/m", early("/m", broken)) == "loaded /m"  # its error said by the load
        assert await AsyncLLM._tokenizer_of("/m", None) == "loaded /m"
        assert loads == ["/m-f32", "/m", "/m"]

    asyncio.run(main())


def test_a_bad_model_gives_no_early_tokenizer():
    """Nothing to convert is ever started by the frontend; a model the core will refuse gives no hint."""
    from tdpipe.config import EngineConfig

    llm = AsyncLLM(EngineConfig(model="/no/such/model"))

    async def main() -> None:
        assert llm._early_tokenizer(asyncio.get_running_loop()) is None

    asyncio.run(main())
