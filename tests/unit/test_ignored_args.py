"""vLLM's engine arguments that mean nothing in tdpipe (tdpipe/ignored_args.py): accepted by LLM(...)'s
keywords and every command's flags, each with one warning saying why; anything else still a TypeError."""
import argparse
import logging

import pytest

from tdpipe.engine_args import EngineArgs
from tdpipe.ignored_args import IGNORED


def test_keywords_are_dropped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="tdpipe"):
        args = EngineArgs.from_kwargs(trust_remote_code=True, swap_space=4, max_num_seqs=7)
    assert args.max_num_seqs == 7
    said = caplog.text
    assert "trust_remote_code=True ignored: tdpipe's architectures are built in" in said
    assert "swap_space=4 ignored" in said
    with pytest.raises(TypeError, match="unexpected engine argument 'trust_remote_cod'"):
        EngineArgs.from_kwargs(trust_remote_cod=True)


def test_flags_parse_and_warn_only_when_given(caplog):
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    with caplog.at_level(logging.WARNING, logger="tdpipe"):
        EngineArgs.from_cli(p.parse_args([]))
        assert caplog.text == ""
        a = p.parse_args(["--trust-remote-code", "--swap-space", "4", "--no-enable-chunked-prefill",
                          "--distributed-executor-backend", "ray", "--max-num-seqs", "3"])
        args = EngineArgs.from_cli(a)
    assert args.max_num_seqs == 3
    for name in ("trust_remote_code=True", "swap_space='4'", "enable_chunked_prefill=False",
                 "distributed_executor_backend='ray'"):
        assert f"{name} ignored" in caplog.text
    assert all(v.why for v in IGNORED.values())
