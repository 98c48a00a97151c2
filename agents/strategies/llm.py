"""An optional LLM proposer: an OpenAI-compatible chat endpoint suggests parameter sets as JSON.

It receives the template, the parameter space and the history; its answers are
validated against the space (unknown families, values outside a knob's list,
broken constraints and repeats are dropped), and whatever it does not supply —
a bad answer, a timeout, no endpoint configured — comes from the guided strategy (after a timeout, for the
rest of the shape's search: the endpoint is not asked again there).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from kernelmill.agents.space import Candidate, Observation, Space
from kernelmill.agents.strategies.base import seen_keys
from kernelmill.agents.strategies.guided import Guided
from kernelmill.settings import get_settings
from kernelmill.templates import template_dir

log = logging.getLogger(__name__)

SYSTEM = (
    "You tune CUDA kernels. Given a kernel template, its parameter space and the trials so far, propose "
    'parameter sets likely to be faster. Answer only JSON: {"candidates": [{"family": str, "params": {...}, '
    '"reason": str}]}, with values taken from the allowed lists.'
)

#: The most of an answer that is read: a few candidates take a few kB, and a larger answer is not held in memory.
MAX_ANSWER_BYTES = 1 << 20


class LlmProposer:
    name = "llm"

    def __init__(self, seed: int = 0, url: str | None = None, api_key: str | None = None, model: str | None = None):
        settings = get_settings()
        self.url = (url or settings.llm_url or "").rstrip("/") or None
        self.api_key = api_key or settings.llm_api_key
        self.model = model or settings.llm_model
        self.timeout_s = settings.llm_timeout_s
        self.fallback = Guided(seed)
        #: Why the endpoint is not asked again (the loop makes a proposer per shape: in this search): it timed
        #: out, and each batch waited the timeout out again, spending the job's time budget on waiting; or its URL
        #: cannot be parsed.
        self.given_up: str | None = None

    def propose(self, space: Space, history: Sequence[Observation], n: int) -> list[Candidate]:
        out: list[Candidate] = []
        why = "no LLM endpoint configured (KERNELMILL_LLM_URL)"
        if self.url and self.given_up:
            why = self.given_up
        elif self.url:
            try:
                out = self._ask(space, history, n)
                why = f"the LLM gave {len(out)} valid of {n}"
            except httpx.InvalidURL as exc:  # not an httpx.HTTPError; and asking again would say the same
                why = self.given_up = f"KERNELMILL_LLM_URL {self.url!r} is not a URL httpx can ask ({exc})"
                log.warning("llm proposer: %s; using the guided strategy", why)
            except httpx.TimeoutException as exc:
                why = f"LLM answer unusable ({type(exc).__name__}: {exc})"
                self.given_up = f"the LLM timed out earlier in this search ({exc}): not asked again"
                log.warning("llm proposer: %s; using the guided strategy for the rest of this search", why)
            # RecursionError: json's decoder gives up on nesting a thousand levels deep (a hostile or broken answer)
            except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
                why = f"LLM answer unusable ({type(exc).__name__}: {exc})"
                log.warning("llm proposer: %s; using the guided strategy", why)
        if len(out) < n:
            picked = {c.key for c in out}
            rest = self.fallback.propose(space, [*history, *(Observation(c, "pending") for c in out)], n - len(out))
            out += [c.because(f"{why}; guided: {c.note}") for c in rest if c.key not in picked]
        return out[:n]

    def _ask(self, space: Space, history: Sequence[Observation], n: int) -> list[Candidate]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {
            "model": self.model,
            "temperature": 0.2,
            "response_format": {"type": "json_object"},
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": _prompt(space, history, n)},
            ],
        }
        # httpx's timeout bounds each read, not the answer: a server sending a byte a second held the job for as
        # long as it liked. The answer is read as it comes, against a deadline and a size.
        deadline = time.monotonic() + self.timeout_s
        url = f"{self.url}/chat/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=self.timeout_s) as resp:
            resp.raise_for_status()
            raw = _read_answer(resp, deadline, self.timeout_s)
        content = json.loads(raw)["choices"][0]["message"]["content"]
        return validate(space, history, parse_answer(content), n)


def _read_answer(resp: httpx.Response, deadline: float, timeout_s: float) -> bytes:
    """``resp``'s body; httpx.ReadTimeout once ``deadline`` passes, ValueError past MAX_ANSWER_BYTES."""
    body = bytearray()
    for chunk in resp.iter_bytes():
        body += chunk
        if len(body) > MAX_ANSWER_BYTES:
            raise ValueError(f"the answer is over {MAX_ANSWER_BYTES} bytes")
        if time.monotonic() > deadline:
            raise httpx.ReadTimeout(f"no whole answer within {timeout_s:g} s", request=resp.request)
    return bytes(body)


def parse_answer(content: str) -> list[dict[str, Any]]:
    """The candidates list from the model's text (tolerates a fenced code block)."""
    if not isinstance(content, str):
        raise TypeError(f"the answer's content is {type(content).__name__}, not text")
    # From the first "{" to the last "}", found by two scans: the regex r"\{.*\}" that said the same backtracked
    # from every "{" where no "}" followed, in time quadratic in the answer's length.
    start, end = content.find("{"), content.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object in the answer")
    data = json.loads(content[start : end + 1])
    items = data["candidates"]
    if not isinstance(items, list):
        raise ValueError("'candidates' is not a list")
    return items


def validate(space: Space, history: Sequence[Observation], items: list[dict[str, Any]], n: int) -> list[Candidate]:
    seen = seen_keys(history)
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("family"), str):  # a list is not hashable
            continue
        if item["family"] not in space.families:
            continue
        fam = space.families[item["family"]]
        params = item.get("params")
        if not isinstance(params, dict) or set(params) != {p.name for p in fam.params}:
            continue
        try:
            coerced = {p.name: p.coerce(params[p.name]) for p in fam.params}
        except ValueError:
            continue
        cand = space.valid(fam.name, coerced)
        if cand is None or cand.key in seen:
            continue
        seen.add(cand.key)
        out.append(cand.because(f"llm: {str(item.get('reason', ''))[:300]}"))
        if len(out) == n:
            break
    return out


def _prompt(space: Space, history: Sequence[Observation], n: int) -> str:
    families = {
        name: {"params": {p.name: list(p.values) for p in fam.params}, "template": _template(fam.template)}
        for name, fam in space.families.items()
    }
    ok = sorted((o for o in history if o.ok), key=lambda o: o.median_ms)[:20]
    failed = [o for o in history if not o.ok][:10]
    return json.dumps(
        {
            "op": space.op.name,
            "dtype": space.dtype,
            "want": n,
            "families": families,
            "fastest": [{"family": o.candidate.family, "params": o.candidate.params, "ms": o.median_ms} for o in ok],
            "failed": [
                {"family": o.candidate.family, "params": o.candidate.params, "status": o.status} for o in failed
            ],
        }
    )


def _template(path: str, limit: int = 6000) -> str:
    try:
        return (template_dir() / path).read_text()[:limit]
    except OSError:
        return ""
