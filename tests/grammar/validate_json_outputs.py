#!/usr/bin/python3
"""Checks structured outputs with an independent validator (Debian's
python3-jsonschema). Input: a JSONL file, one {"id", "schema", "text"} per
line. Every text must parse as JSON and validate against its schema (the
validator class the schema's $schema names, Draft 2020-12 by default).
Prints one line per failure and a summary; exits 1 if any failed."""
import json
import sys

import jsonschema


def main(path):
    n_ok = 0
    failures = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            case = json.loads(line)
            try:
                value = json.loads(case["text"])
            except ValueError as e:
                failures.append(f"{case['id']}: not JSON ({e}): {case['text']!r}")
                continue
            cls = jsonschema.validators.validator_for(case["schema"], default=jsonschema.Draft202012Validator)
            errors = sorted(cls(case["schema"]).iter_errors(value), key=str)
            if errors:
                failures.append(f"{case['id']}: {errors[0].message}: {case['text']!r}")
            else:
                n_ok += 1
    for msg in failures:
        print(msg)
    print(f"validated {n_ok} of {n_ok + len(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
