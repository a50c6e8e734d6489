"""The prefix cache tells a client nothing about another's prompts: a probe that guesses the next token of
someone else's prompt gets the same ``cached_tokens`` whether the guess is right or wrong, across API keys
(``--prefix-cache-scope key``, the default) and across ``cache_salt`` values; within one scope the same
probe does tell (the control), and the tokens are those of decoding without the cache."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from onnxgen import LLM, load
from onnxgen.server.app import create_app
from onnxgen.server.scheduler import SchedulerConfig
from onnxgen.server.security import SecurityConfig

CONFIG = SchedulerConfig(max_batch=2, max_queue=4, max_model_len=128)
SECRET = [int(t) for t in np.random.default_rng(7).integers(3, 250, 24)]
KNOWN = 12  # tokens of the secret the prober knows; it guesses the next one
WRONG = next(t for t in range(3, 250) if t != SECRET[KNOWN])
ALICE, BOB = "alice-key", "bob-key"


@pytest.fixture(scope="module")
def model(server_models: dict[str, Path]) -> Path:
    return server_models["genai-dense"]


@pytest.fixture(scope="module")
def cached(model: Path) -> LLM:
    return load(model, threads=1, prefix_cache_mb=8)


@contextmanager
def client(llm: LLM, keys: tuple[str, ...] = (), scope: str = "key") -> Iterator[TestClient]:
    if llm.prefix_cache is not None:
        llm.prefix_cache.clear()
    security = SecurityConfig(api_key=keys or None)
    app = create_app(llm, CONFIG, security=security, prefix_cache_scope=scope)
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        yield c


def complete(c: TestClient, prompt: list[int], key: str | None = None, **extra: Any) -> dict[str, Any]:
    """A greedy completion of ``prompt``, sent with ``key`` and the body fields ``extra``."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    r = c.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def probe(c: TestClient, guess: int, key: str | None = None, **extra: Any) -> int:
    """Cached tokens of the known head, a guess and one more token (so a right guess can be resumed)."""
    answer = complete(c, [*SECRET[:KNOWN], guess, 3], key, **extra)
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def observed(
    llm: LLM, scope: str, owner: dict[str, Any], prober: dict[str, Any], secret: bool = True
) -> list[int]:
    """What a prober sees (cached tokens of a right and of a wrong guess, and of both again) after the
    owner sent the secret (``secret``), or on a cache that never saw it: where the two are equal, the
    prober learns nothing about the owner's prompt."""
    keys = tuple(sorted({k for k in (owner.get("key"), prober.get("key")) if k}))
    with client(llm, keys, scope) as c:
        if secret:
            complete(c, SECRET, **owner)
        guesses = [SECRET[KNOWN], WRONG, SECRET[KNOWN], WRONG]
        return [probe(c, g, **prober) for g in guesses]


def test_a_probe_within_one_scope_does_tell_a_right_guess_from_a_wrong_one(cached: LLM) -> None:
    seen = observed(cached, "key", {}, {})  # no keys, no salt: one user, one cache (the control)
    assert seen[:2] == [KNOWN + 1, KNOWN] and seen != observed(cached, "key", {}, {}, secret=False)


def test_another_api_key_learns_nothing_from_cached_tokens(cached: LLM) -> None:
    alice, bob = {"key": ALICE}, {"key": BOB}
    assert observed(cached, "key", alice, bob) == observed(cached, "key", alice, bob, secret=False)
    assert observed(cached, "key", alice, alice)[0] == KNOWN + 1  # the owner still resumes from the cache


def test_the_shared_scope_lets_every_key_resume_from_every_prompt(cached: LLM) -> None:
    assert observed(cached, "shared", {"key": ALICE}, {"key": BOB})[:2] == [KNOWN + 1, KNOWN]


def test_another_cache_salt_learns_nothing_whatever_the_scope(cached: LLM) -> None:
    alice = {"cache_salt": "alice"}
    for scope in ("key", "shared", "salt"):
        for prober in ({"cache_salt": "bob"}, {}, {"key": BOB, "cache_salt": "bob"}):
            owner = {**alice, "key": ALICE} if "key" in prober else alice
            seen = observed(cached, scope, owner, prober)
            assert seen == observed(cached, scope, owner, prober, secret=False), (scope, prober)
        assert observed(cached, scope, alice, alice)[0] == KNOWN + 1, scope


def test_the_salt_scope_shares_nothing_between_requests_without_a_salt(cached: LLM) -> None:
    with client(cached, scope="salt") as c:
        complete(c, SECRET)
        assert complete(c, SECRET)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_bad_cache_salt_or_scope_is_refused(cached: LLM) -> None:
    with client(cached) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "cache_salt": ""})
        assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "hi", "cache_salt": 5})
        assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="prefix-cache-scope"):
        create_app(cached, CONFIG, prefix_cache_scope="user")


def test_replies_are_the_same_with_the_cache_on_and_off_in_every_scope(cached: LLM, model: Path) -> None:
    prompts = [SECRET, [*SECRET[:KNOWN], WRONG, 3], SECRET]
    with client(load(model, threads=1), scope="key") as c:  # no cache at all
        plain = [complete(c, p)["choices"][0]["text"] for p in prompts]
    for scope, keys, key, salt in [
        ("key", (), None, {}),
        ("key", (ALICE,), ALICE, {"cache_salt": "s"}),
        ("salt", (), None, {"cache_salt": "s"}),
        ("shared", (), None, {}),
    ]:
        with client(cached, keys, scope) as c:
            answers = [complete(c, p, key, **salt) for p in prompts]
        assert [a["choices"][0]["text"] for a in answers] == plain, scope
        assert answers[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, scope  # it did resume


def test_the_library_shares_cached_prefixes_only_within_one_cache_salt(cached: LLM) -> None:
    assert cached.prefix_cache is not None
    cached.prefix_cache.clear()
    cached.generate(SECRET, max_new_tokens=2, cache_salt="alice")
    head = [*SECRET[: KNOWN + 1], 3]
    seen = {
        salt: cached.generate(head, max_new_tokens=2, cache_salt=salt).stats["cached_tokens"]
        for salt in ("bob", None, "alice")
    }
    assert seen == {"bob": 0, None: 0, "alice": KNOWN + 1}
    with pytest.raises(ValueError, match="cache_salt"):
        cached.generate(head, max_new_tokens=2, cache_salt="")
