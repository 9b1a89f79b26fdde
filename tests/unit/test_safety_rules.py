"""The safety rules alone (no Kafka): Luhn, what fires, what does not, and that evidence never carries a secret."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processors.safety.rules import (
    DEFAULT_RULES,
    Category,
    Target,
    digits,
    luhn_valid,
    params_texts,
    scan,
)

TOOL, PARAMS = Target.TOOL_RESULT, Target.ACTION_PARAMS
SENSITIVE = {r.name for r in DEFAULT_RULES if r.category is not Category.DESTRUCTIVE}


def fired(text: str, target: Target = TOOL) -> dict[str, str]:
    """Rule name -> evidence; params are decoded first, as the evaluator does."""
    texts = params_texts(text) if target is PARAMS else [text]
    return {f.rule.name: f.summary for f in scan(texts, target)}


# --- Luhn ----------------------------------------------------------------------------------------------------------


def check_digit(payload: str) -> str:
    """The digit that makes payload + digit Luhn-valid, computed the textbook way (independent of luhn_valid)."""
    total = 0
    for i, c in enumerate(reversed(payload)):
        d = int(c)
        if i % 2 == 0:  # these positions are doubled once the check digit is appended
            d = d * 2 - 9 if d * 2 > 9 else d * 2
        total += d
    return str((10 - total % 10) % 10)


def test_luhn_known_numbers() -> None:
    assert luhn_valid("79927398713") and luhn_valid("4111 1111 1111 1111") and luhn_valid("378282246310005")
    assert not luhn_valid("79927398710") and not luhn_valid("4111111111111112") and not luhn_valid("")


@given(st.text(alphabet=string.digits, min_size=1, max_size=30), st.data())
def test_luhn_accepts_the_check_digit_and_catches_any_single_digit_error(payload: str, data: st.DataObject) -> None:
    number = payload + check_digit(payload)
    assert luhn_valid(number)
    position = data.draw(st.integers(0, len(number) - 1))
    wrong = data.draw(st.sampled_from([d for d in string.digits if d != number[position]]))
    assert not luhn_valid(number[:position] + wrong + number[position + 1 :])


@st.composite
def card_numbers(draw: st.DrawFn) -> str:
    prefix = draw(st.sampled_from(["4", "51", "55", "22", "34", "37", "6011", "65"]))
    length = draw(st.sampled_from([15, 16]) if prefix in ("34", "37") else st.sampled_from([16, 19]))
    body = prefix + draw(
        st.text(alphabet=string.digits, min_size=length - 1 - len(prefix), max_size=length - 1 - len(prefix))
    )
    number = body + check_digit(body)
    separator = draw(st.sampled_from(["", " ", "-"]))
    return separator.join(number[i : i + 4] for i in range(0, len(number), 4))


@given(card_numbers())
def test_valid_card_numbers_fire_and_show_only_the_last_four_digits(card: str) -> None:
    found = fired(f"card on file: {card}, thanks")
    assert set(found) == {"credit_card"}
    assert digits(found["credit_card"]) == digits(card)[-4:]
    broken = card[:-1] + str((int(card[-1]) + 1) % 10)  # one digit off: fails Luhn
    assert "credit_card" not in fired(f"card on file: {broken}, thanks")


# --- what fires ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rule", "evidence"),
    [
        ("reach me at john.doe@example.com today", "email", "j***@example.com"),
        ("call +1 415-555-0134", "phone_number", "+* ***-***-**34"),
        ("office (212) 555-7890.", "phone_number", "(***) ***-**90"),
        ("tel: +44 20 7946 0958", "phone_number", "+** ** **** **58"),
        ("SSN 123-45-6789 on record", "us_ssn", "***-**-****"),
        ("OPENAI_API_KEY=sk-proj-Abc123def456ghi789jkl012", "openai_api_key", "sk-***"),
        ("aws_access_key_id = AKIAIOSFODNN7EXAMPLE", "aws_access_key_id", "AKIA***"),
        ("token ghp_" + "a1B2" * 9, "github_token", "ghp_***"),
        ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEA", "private_key", "[private key block]"),
    ],
)
def test_each_sensitive_rule_fires_with_redacted_evidence(text: str, rule: str, evidence: str) -> None:
    assert fired(text) == {rule: evidence}
    assert fired(json.dumps({"body": text}), PARAMS) == {rule: evidence}, "params are scanned as well"


def test_several_matches_of_one_rule_are_one_finding_with_a_count() -> None:
    [finding] = scan(["a@example.com and b@example.org", "c@example.net"], TOOL)
    assert (finding.rule.name, finding.count, finding.summary) == ("email", 3, "a***@example.com (+2 more)")


@pytest.mark.parametrize(
    ("params", "rule"),
    [
        ({"cmd": "rm -rf /"}, "destructive_shell"),
        ({"cmd": "sudo rm -rf --no-preserve-root / && echo done"}, "destructive_shell"),
        ({"cmd": "rm -fr ~"}, "destructive_shell"),
        ({"cmd": "cd /srv; rm -r *"}, "destructive_shell"),
        ({"cmd": "mkfs.ext4 /dev/sda1"}, "destructive_shell"),
        ({"cmd": "dd if=/dev/zero of=/dev/sda bs=1M"}, "destructive_shell"),
        ({"cmd": ":(){ :|:& };:"}, "destructive_shell"),
        ({"sql": "DROP TABLE users"}, "destructive_sql"),
        ({"sql": "drop database prod;"}, "destructive_sql"),
        ({"sql": "TRUNCATE TABLE orders"}, "destructive_sql"),
        ({"sql": "DELETE FROM orders;"}, "destructive_sql"),
        ({"steps": [{"sql": "DELETE FROM orders"}]}, "destructive_sql"),
    ],
)
def test_destructive_commands_in_dispatched_params(params: dict, rule: str) -> None:
    found = fired(json.dumps(params), PARAMS)
    assert set(found) == {rule}
    assert any(found[rule] in text for text in params_texts(json.dumps(params))), "commands are shown verbatim"
    assert fired(json.dumps(params), TOOL) == {}, "a tool printing a command is not running it"


@pytest.mark.parametrize(
    "params",
    [
        {"cmd": "rm -rf /tmp/build"},
        {"cmd": "rm -rf ./node_modules"},
        {"cmd": "rm notes.txt"},
        {"sql": "DELETE FROM orders WHERE id = 42"},
        {"sql": "SELECT * FROM drop_table_audit"},
        {"q": "how do I drop a table in postgres"},
        {"q": "truncate the summary to 100 words"},
    ],
)
def test_ordinary_commands_are_not_destructive(params: dict) -> None:
    assert fired(json.dumps(params), PARAMS) == {}


def test_params_are_decoded_so_json_escapes_hide_nothing() -> None:
    params = '{"to": "jane\\u0040example.com", "note": "line1\\nrm -rf /"}'
    assert fired(params, PARAMS) == {"email": "j***@example.com", "destructive_shell": "rm -rf /"}
    assert params_texts("not json at all") == ["not json at all"]
    assert params_texts('{"a": [1, {"b": "c"}], "d": null}') == ["a", "b", "c", "d"]


# --- what does not fire --------------------------------------------------------------------------------------------

PLAIN_TEXTS = [
    '{"orders": [{"id": 18233, "total": 129.99, "status": "shipped", "eta": "2025-10-12"}]}',
    "Weather in Paris: 18°C, humidity 72%, wind 12 km/h. Updated 14:05 UTC.",
    "Traceback (most recent call last):\n  File \"/srv/app/main.py\", line 42, in handler\nKeyError: 'sku'",
    "Found 3 results for 'red shoes' (page 1 of 12), request id 0199c9a0-0000-7000-8000-000000000001",
    "version 1.2.3 released on 2025-10-09; build 20251009.4; commit 9f8e7d6c5b4a",
    "ts=1760000000000000 offset=123456789 partition=7 lag=0",
    "Use the form at https://example.com/contact to reach us; IP 10.0.0.1, port 8080.",
    "ISBN 978-3-16-148410-0 and order number 2025-0042-17",
    "The price is $1,299.00 (was $1,499.00); SKU 400-12-3456-B",
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ is a *public* key; skill-based routing; task-force",
]


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_no_rule_fires_on_ordinary_tool_output(text: str) -> None:
    assert fired(text) == {} and fired(json.dumps({"q": text}), PARAMS) == {}


_WORDS = st.text(alphabet=string.ascii_letters, min_size=1, max_size=12)
_HARMLESS = st.one_of(
    _WORDS,
    st.integers(0, 999_999_999).map(str),  # ids, counts, amounts: at most 9 digits, no separators
    st.floats(0, 1e6, allow_nan=False).map(lambda x: f"{x:.2f}"),
    st.dates().map(str),
    st.times().map(lambda t: t.strftime("%H:%M")),
    st.uuids().map(str),
    st.sampled_from(["OK", "error:", "status=200", "->", "(n/a)", "sk", "AKIA", "rm", "DROP", "@", "-rf"]),
)


@settings(max_examples=300)
@given(st.lists(st.tuples(_WORDS, _HARMLESS), max_size=30), st.sampled_from([" ", ", ", "; ", "\n"]))
def test_no_false_positive_on_plain_text(pairs: list[tuple[str, str]], separator: str) -> None:
    # words and harmless tokens alternate, so unrelated numbers never line up into a card or phone number
    text = separator.join(f"{word} {token}" for word, token in pairs)
    assert scan([text], TOOL) == [], text


# --- redaction -----------------------------------------------------------------------------------------------------

_ALNUM = string.ascii_letters + string.digits
_secrets = st.one_of(
    st.builds(
        lambda local, domain, tld: f"{local}@{domain}.{tld}",
        st.text(alphabet=_ALNUM + "._+", min_size=1, max_size=20).filter(lambda s: s[0] in _ALNUM),
        st.text(alphabet=string.ascii_lowercase + string.digits, min_size=1, max_size=15),
        st.sampled_from(["com", "org", "io", "co.uk", "example"]),
    ),
    card_numbers(),
    st.builds(
        lambda a, b, c: f"{a:03d}-{b:02d}-{c:04d}",
        st.integers(1, 665),
        st.integers(1, 99),
        st.integers(1, 9999),
    ),
    st.builds(
        lambda area, mid, last: f"+1 {area}-{mid}-{last}",
        st.integers(200, 999),
        st.integers(200, 999),
        st.integers(1000, 9999),
    ),
    st.text(alphabet=_ALNUM + "_-", min_size=20, max_size=48).map(lambda s: "sk-" + s),
    st.text(alphabet=string.ascii_uppercase + string.digits, min_size=16, max_size=16).map(lambda s: "AKIA" + s),
)


@settings(max_examples=300)
@given(_secrets, st.sampled_from(["", "see ", "value: "]), st.sampled_from(["", " please", ".", "\n"]))
def test_evidence_never_contains_the_raw_match(secret: str, before: str, after: str) -> None:
    findings = scan([before + secret + after], TOOL)
    assert findings, f"{secret!r} should fire"
    for finding in findings:
        assert finding.rule.name in SENSITIVE
        assert secret not in finding.summary
        for match in finding.rule.matches(before + secret + after):
            assert match not in finding.evidence


@pytest.mark.parametrize(
    "text",
    [
        "created 100fa1da-de30-9694-1179-0298ebc354de",  # its groups' digits 30-9694-1179-0298 pass Luhn
        "trace 0298ebc354de30969411790298ebc354de",
        "ids: 5fa1-4111-1111-1111-1111",
    ],
)
def test_a_card_number_is_not_read_across_the_groups_of_an_id(text: str) -> None:
    assert scan([text], TOOL) == [], text


@given(st.uuids(), st.sampled_from(["", " ", "id=", "(", "/"]))
def test_no_uuid_is_a_card_number(uuid: object, prefix: str) -> None:
    text = f"{prefix}{uuid}"
    assert not any(f.rule == "credit_card" for f in scan([text], TOOL)), text
