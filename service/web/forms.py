"""The new-job form: parse, validate exactly as the API does, and say what is wrong next to each field.

Validation is the API's: the request schema (``JobCreate``: arch pattern,
budget bounds) and then ``validate_submission``. That function stops at its
first problem, so the form calls it again with each field it complained about
replaced by a valid value, until it passes: every field's first problem shows.

Writes are guarded like the API's: the token when ``KERNELMILL_API_TOKEN`` is
set, and always a double-submit CSRF token (a SameSite=Strict cookie that must
match a hidden field) with no browser saying the post came from another site's
page (Sec-Fetch-Site), so another site cannot post the form from a browser.
"""

from __future__ import annotations

import hmac
import re
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from pydantic import ValidationError

from kernelmill.agents.strategies import STRATEGIES
from kernelmill.kernels.ops import DTYPES, OPS
from kernelmill.kernels.ops.base import SpecError
from kernelmill.service.api.deps import from_another_site
from kernelmill.service.api.schemas import Budget, JobCreate
from kernelmill.service.db.models import Job
from kernelmill.service.db.store import Store
from kernelmill.service.jobs import MIN_BUDGET_SECONDS, JobError, validate_submission
from kernelmill.settings import Settings

CSRF_COOKIE = "kernelmill_csrf"
GENERAL = "form"  # errors that belong to no one field


def new_csrf_token() -> str:
    return secrets.token_urlsafe(32)


def parse_body(body: bytes) -> dict[str, str]:
    """An application/x-www-form-urlencoded body as a dict (the last value of a repeated name wins)."""
    return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))


def attr_field(op: str, name: str) -> str:
    return f"attr.{op}.{name}"


@dataclass
class JobForm:
    op: str = "softmax"
    shapes: str = ""
    dtype: str = "float16"
    strategy: str = "random"
    arch: str = "auto"
    families: str = ""  # comma-separated; empty: the op's default families
    trials: str = str(Budget.model_fields["trials"].default)
    seconds: str = f"{Budget.model_fields['seconds'].default:g}"
    attrs: dict[str, str] = field(default_factory=dict)  # "attr.<op>.<name>" -> value, every op's
    token: str = ""
    csrf: str = ""
    errors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_pairs(cls, data: Mapping[str, str]) -> JobForm:
        """From a posted body or the query string (which pre-fills the form, e.g. from /compare)."""
        form = cls()
        for name in ("op", "shapes", "dtype", "strategy", "arch", "families", "trials", "seconds", "token", "csrf"):
            if name in data:
                setattr(form, name, str(data[name]).strip()[:4000])
        form.shapes = form.shapes.replace(";", "\n")
        form.attrs = {k: _attr_option(k, str(v).strip()[:4000]) for k, v in data.items() if k.startswith("attr.")}
        return form

    def shape_list(self) -> list[str]:
        return [line.strip() for line in re.split(r"[\n;]+", self.shapes) if line.strip()]

    def family_list(self) -> list[str] | None:
        names = [name.strip() for name in self.families.split(",") if name.strip()]
        return names or None

    def op_attrs(self) -> dict[str, str]:
        """The attributes given for the chosen op (empty values mean the op's default)."""
        prefix = f"attr.{self.op}."
        return {k[len(prefix) :]: v for k, v in self.attrs.items() if k.startswith(prefix) and v}


def _attr_option(key: str, value: str) -> str:
    """An attribute field's value as its select's option reads where it is one ("1e-5" is the option "1e-05",
    "RELU" is "relu"), so a pre-filled link selects it; else as given, to show next to its error."""
    _, op, name = (key.split(".", 2) + ["", ""])[:3]
    param = next((a for a in OPS[op].attributes if a.name == name), None) if op in OPS else None
    if param is None or not value:
        return value
    try:
        return str(param.coerce(value, "attribute"))
    except SpecError:
        return value


@dataclass
class Submission:
    form: JobForm
    job: Job | None = None
    status_code: int = 200


def choices(settings: Settings) -> dict[str, Any]:
    """What the form offers: ops with their dims and attributes, dtypes, strategies, limits."""
    ops = []
    for spec in OPS.values():
        ops.append(
            {
                "name": spec.name,
                "dims": " x ".join(spec.dims),
                "example": spec.example(),
                "attributes": [
                    {"name": a.name, "field": attr_field(spec.name, a.name), "options": list(a.values), "doc": a.doc}
                    for a in spec.attributes
                ],
                "families": list(spec.families),
            }
        )
    strategies = [{"name": name, "doc": _first_line(cls)} for name, cls in STRATEGIES.items()]
    return {
        "ops": ops,
        "dtypes": DTYPES,
        "strategies": strategies,
        "max_trials": settings.max_budget_trials,
        "min_seconds": MIN_BUDGET_SECONDS,
        "max_seconds": settings.max_budget_seconds,
        "max_shapes": settings.max_shapes,
        "needs_token": bool(settings.api_token),
    }


def _first_line(cls: type) -> str:
    """The first line of a strategy's class docstring, else of its module's."""
    doc = cls.__doc__ or getattr(sys.modules.get(cls.__module__), "__doc__", None) or ""
    lines = doc.strip().splitlines()
    return lines[0] if lines else ""


def field_of(message: str, op: str) -> str:
    """Which form field a validation message is about."""
    m = message.lower()
    if m.startswith("unknown op"):
        return "op"
    if m.startswith("unknown dtype") or (m.startswith("no ") and " family supports " in m):
        return "dtype"
    if m.startswith("shapes") or "shape" in m.split(":")[0]:
        return "shapes"
    if m.startswith("unknown strategy"):
        return "strategy"
    if m.startswith("budget.trials"):
        return "trials"
    if m.startswith("budget.seconds"):
        return "seconds"
    if m.startswith("arch:"):
        return "arch"
    if m.startswith("families:") or " has no family " in m or "different precisions" in m:
        return "families"
    attr = re.match(r"attribute (\w+)=", message)
    if attr and op in OPS and any(a.name == attr.group(1) for a in OPS[op].attributes):
        return attr_field(op, attr.group(1))
    return GENERAL


def _safe_shape(op: str) -> list[str]:
    spec = OPS.get(op) or next(iter(OPS.values()))
    return ["x".join("1" for _ in spec.dims)]


def validation_errors(settings: Settings, form: JobForm) -> tuple[dict[str, str], dict[str, Any] | None]:
    """(errors by field, normalized job fields when there are none)."""
    errors: dict[str, str] = {}
    trials = seconds = None
    if re.fullmatch(r"\s*[0-9]+\s*", form.trials):  # not int() alone: it reads "1_0" and "１０" too
        trials = int(form.trials)
    else:
        errors["trials"] = f"a whole number of trials, 1 to {settings.max_budget_trials}"
    # A decimal number in ASCII: float() reads "1_0", "１０", "inf" and "nan" too.
    if re.fullmatch(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*", form.seconds):
        seconds = float(form.seconds)
    else:
        errors["seconds"] = f"a number of seconds, {MIN_BUDGET_SECONDS:g} to {settings.max_budget_seconds:g}"

    shapes = form.shape_list()
    args: dict[str, Any] = {
        "op": form.op,
        "shapes": shapes,
        "dtype": form.dtype,
        "strategy": form.strategy,
        "budget_trials": trials if trials is not None else 1,
        "budget_seconds": seconds if seconds is not None else MIN_BUDGET_SECONDS,
        "attrs": form.op_attrs(),
        "arch": form.arch,
        "families": form.family_list(),
    }
    fields = None
    for _ in range(12):
        try:
            fields = validate_submission(settings, **args)
            break
        except JobError as exc:
            name = field_of(str(exc), args["op"])
            errors.setdefault(name, str(exc))
            if name == GENERAL:
                break
            if name == "op":  # nothing about the shapes or attributes can be said for an unknown op
                args.update(op=next(iter(OPS)), attrs={})
                args["shapes"] = _safe_shape(args["op"])
            elif name == "dtype":
                args["dtype"] = DTYPES[0]
            elif name == "shapes":
                args["shapes"] = _safe_shape(args["op"])
            elif name == "strategy":
                args["strategy"] = next(iter(STRATEGIES))
            elif name == "trials":
                args["budget_trials"] = 1
            elif name == "seconds":
                args["budget_seconds"] = MIN_BUDGET_SECONDS
            elif name == "arch":
                args["arch"] = "auto"
            elif name == "families":
                args["families"] = None
            else:
                args["attrs"] = {}
    try:  # the API's request schema: arch pattern and budget bounds
        JobCreate(
            op=form.op,
            shapes=shapes or ["1"],
            dtype=form.dtype,
            arch=form.arch,
            strategy=form.strategy,
            attrs=form.op_attrs(),
            budget={"trials": trials or 1, "seconds": seconds or 1.0},
        )
    except ValidationError as exc:
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ())]
            name = {"arch": "arch", "trials": "trials", "seconds": "seconds"}.get(loc[-1] if loc else "", GENERAL)
            if name == "arch":
                errors.setdefault(name, "'auto' (the worker's GPU) or an arch such as sm_90 or sm_90a")
            errors.setdefault(name, f"{err.get('msg')}")

    return errors, (fields if not errors else None)


def submit_job(
    store: Store, settings: Settings, form: JobForm, csrf_cookie: str | None, sec_fetch_site: str | None = None
) -> Submission:
    """Check the CSRF and API tokens, validate, create the job; errors come back on the form."""
    if not _same_site_form(form.csrf, csrf_cookie, sec_fetch_site):
        form.errors = {GENERAL: "This form expired or came from another site: reload the page and submit again."}
        return Submission(form, status_code=403)
    errors, fields = validation_errors(settings, form)
    status_code = 422 if errors else 201
    if settings.api_token and not hmac.compare_digest(form.token.encode(), settings.api_token.encode()):
        errors["token"] = (
            "this server needs its API token for writes (KERNELMILL_API_TOKEN)" if not form.token else "wrong token"
        )
        status_code = 401
    form.token = ""  # never echoed back into the page
    form.errors = errors
    if errors or fields is None:
        return Submission(form, status_code=status_code)
    return Submission(form, store.create_job(**fields), 201)


def check_write(
    settings: Settings, data: Mapping[str, str], csrf_cookie: str | None, sec_fetch_site: str | None = None
) -> str | None:
    """Why a posted button (cancel) may not write, or None."""
    if not _same_site_form(data.get("csrf", ""), csrf_cookie, sec_fetch_site):
        return "This form expired or came from another site: reload the page and try again."
    token = data.get("token", "")
    if settings.api_token and not hmac.compare_digest(token.encode(), settings.api_token.encode()):
        return "This server needs its API token for writes (KERNELMILL_API_TOKEN)." if not token else "Wrong token."
    return None


def _same_site_form(given: str, csrf_cookie: str | None, sec_fetch_site: str | None) -> bool:
    """The form's CSRF field matches its cookie, and no browser said it was posted from another site's page:
    another site can set the cookie where it shares the host (cookies ignore ports) or the parent domain."""
    if from_another_site(sec_fetch_site):
        return False
    return bool(csrf_cookie and given and hmac.compare_digest(csrf_cookie.encode(), given.encode()))
