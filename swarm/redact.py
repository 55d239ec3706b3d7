"""Secrets out of log text: ``redact(text)`` replaces anything shaped like a credential with
``[redacted]``.

It runs on every log line a fellow ships (agent/logship.py), so an ordinary line costs a
lower-casing, 14 substring tests and one literal-anchored search (about 2 us for 100
characters) and comes back unchanged, the same object. A rule's regex runs only when the
substrings it needs are in the line. Pure: no I/O, no state.

What it catches: private key blocks (also cut off at the end of the text), JWTs (base64url
JSON, ``eyJ...``, also a truncated one), NATS nkey seeds (``S`` + ``U``/``A``/``O``/``N``/
``C``/``X`` + 56 base32 characters), ``Bearer <x>`` and ``Authorization: Basic|token <x>``,
``name=value`` where the name ends in token, secret, ticket, password, creds, signature or an
api/access/private key (query strings such as ``?token=``/``access_token=``/``ticket=``,
``KEY=VALUE`` environment lines, ``--password=x``), the same names as quoted keys
(``"token": "..."``), token headers (``X-...-Token: x``, ``Cookie:``) and the password in a
URL's user info. Names are kept, values go: ``?token=[redacted]``. Plural names are counts,
not credentials: ``max_new_tokens=40`` stays.
"""

from __future__ import annotations

import re

REDACTED = "[redacted]"

# A name whose value is a secret ends in one of these.
_KEYWORDS = ("token", "secret", "ticket", "password", "passwd", "key", "signature", "creds")
_NAME = (
    r"[\w.-]*?(?:token|secret|ticket|password|passwd|api[_-]?key|access[_-]?key"
    r"|private[_-]?key|signature|creds)"
)
_VALUE_END = r"[^\s&#\"'<>,;]+"


class _Rule:
    """A substitution that runs only when one of ``any_of`` (and ``also``, if given) is in the
    lower-cased text; none at all: only when the text holds a seed."""

    __slots__ = ("also", "any_of", "pattern", "replacement")

    def __init__(
        self, any_of: tuple[str, ...], pattern: str, replacement: str, also: str = ""
    ) -> None:
        self.any_of = any_of
        self.also = also
        self.pattern = re.compile(pattern, re.S)
        self.replacement = replacement

    def applies(self, low: str) -> bool:
        for hint in self.any_of:
            if hint in low:
                return self.also in low
        return False


_RULES = (
    # PEM private keys (RSA, EC, OPENSSH, PKCS#8, encrypted): the whole block, or the rest of
    # the text when the block is cut off.
    _Rule(
        ("-----begin",),
        r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*-----|\Z)",
        REDACTED,
    ),
    _Rule(("bearer",), r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]+", rf"\1 {REDACTED}"),
    _Rule(
        ("authoriz",),
        r"(?i)\b(authorization[\"']?\s*[:=]\s*[\"']?(?:basic|token))\s+[A-Za-z0-9._~+/=-]+",
        rf"\1 {REDACTED}",
    ),
    # JWTs: base64url of '{"' and more; 1 to 3 segments, so a truncated one goes too.
    _Rule(("eyj",), r"(?<![\w-])eyJ[\w-]{8,}(?:\.[\w-]*){0,2}", REDACTED),
    # nkey seeds: operator, account, user (and server, cluster, curve).
    _Rule((), r"(?<![A-Z2-7])S[UAONCX][A-Z2-7]{56}", REDACTED),
    # name=value: query parameters, environment lines, --flag=value.
    _Rule(
        tuple(f"{k}=" for k in _KEYWORDS),
        rf"(?i)(?<![\w.-])({_NAME})=(?!\[redacted\]){_VALUE_END}",
        rf"\1={REDACTED}",
    ),
    # "name": "value" and 'name': 'value' (JSON, Python reprs).
    _Rule(
        ('"', "'"),
        rf"(?i)([\"'])({_NAME})\1(\s*:\s*)([\"'])(?:\\.|(?!\4).)*?\4",
        rf"\1\2\1\3\4{REDACTED}\4",
    ),
    # Headers: X-Whatever-Token: value, Cookie: value.
    _Rule(
        ("x-", "cookie"),
        r"(?i)\b(x-[\w-]*(?:token|secret|key)|cookie|set-cookie)(\s*:\s*)"
        r"(?!\[redacted\])[^\s,;]+",
        rf"\1\2{REDACTED}",
    ),
    # scheme://user:password@host
    _Rule(
        ("@",),
        r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]+:)[^/\s@]+@",
        rf"\1{REDACTED}@",
        also="://",
    ),
)
# Every rule needs one of these (the seed rule aside): most lines have none of them.
_GATE = ("-----begin", "bearer", "authoriz", "eyj", "cookie", "@", *_KEYWORDS)
# Searched for as such (a leading literal is fast); the rule itself also checks what precedes.
_SEED = re.compile(r"S[UAONCX][A-Z2-7]{56}")


def redact(text: str) -> str:
    """``text`` with every secret-shaped part replaced by ``[redacted]`` (``text`` itself,
    unchanged, when nothing in it looks like one)."""
    low = text.lower()
    hinted = any(hint in low for hint in _GATE)
    seed = _SEED.search(text) is not None
    if not hinted and not seed:
        return text
    for rule in _RULES:
        if seed if not rule.any_of else hinted and rule.applies(low):
            text = rule.pattern.sub(rule.replacement, text)
    return text
