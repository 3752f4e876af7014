#!/bin/sh
# Checks that every commit subject since the rule began is at most 72
# characters (make lint runs it; .githooks/commit-msg checks one message
# as it is written: git config core.hooksPath .githooks).
# Usage: scripts/check-subjects.sh [FILE]  (FILE: one commit message)
set -eu
max=72
if [ $# -eq 1 ]; then
	subject=$(sed -n '/^[^#]/{p;q;}' "$1")
	if [ ${#subject} -gt $max ]; then
		echo "commit subject is ${#subject} characters, over $max: $subject" >&2
		exit 1
	fi
	exit 0
fi
# The rule holds from this commit on; earlier subjects stay as written.
base=0debf6bf
range="$base..HEAD"
if ! git cat-file -e "$base^{commit}" 2>/dev/null; then
	if [ "$(git rev-parse --is-shallow-repository 2>/dev/null)" != true ]; then
		echo "check-subjects: commit $base is not in this history" >&2
		exit 1
	fi
	echo "check-subjects: a shallow clone without $base: checking HEAD's subject only" >&2
	range="-1 HEAD"
fi
# shellcheck disable=SC2086 # range is one or two arguments
bad=$(git log --format=%s $range | awk -v max=$max 'length($0) > max')
if [ -n "$bad" ]; then
	echo "commit subjects over $max characters:" >&2
	echo "$bad" >&2
	exit 1
fi
