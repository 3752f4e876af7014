package main

import (
	"bufio"
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

var (
	reCheckCommit = regexp.MustCompile(`\bcommit ([0-9a-f]{7,40})\b`)
	reCheckPart   = regexp.MustCompile(`^== (lookups-\S+)\.txt\s*$`)
	reCheckLookup = regexp.MustCompile(`^(alone|beside loads) (table|table-python|stand-in|daemon) p50 (\d+(?:\.\d+)?) p99 (\d+(?:\.\d+)?) max \d+(?:\.\d+)? n \d+ due (\d+|-)(?: GB/s [0-9.]+)?\s*$`)
)

// ParseCheckFile reads the output of scripts/gpu-check.sh: "#" lines (the
// first "commit HEX" in them is the commit it ran), gpu-check's parts, and
// after them the lookups parts' raw lines, each under "== lookups-NAME.txt":
// "alone|beside loads table|table-python|stand-in|daemon p50 X p99 Y max Z
// n N due D|- [GB/s G]" (µs; due "-": back to back, else paced;
// table-python: the table through the client's Python probe where the C
// one answered "table"; stand-in: the table probe's stand-in). Only those
// sections
// are read: each gives a LookupLine per situation. A line in them that does
// not parse, a part that mixes paced and back-to-back lines, or a figure
// given twice is an error naming the line.
func ParseCheckFile(name, text string) (*CallFile, error) {
	f := &CallFile{Name: name}
	c := Call{N: 1, Line: 1}
	var (
		part  string // the current lookups part, "" outside one
		lines map[string]*LookupLine
		order []string
		due   string
	)
	endPart := func() {
		for _, s := range order {
			c.Lookups = append(c.Lookups, *lines[s])
		}
		part, lines, order, due = "", nil, nil, ""
	}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	n := 0
	for sc.Scan() {
		n++
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			f.noteDate(line)
			c.noteCommit(line)
			continue
		}
		if strings.HasPrefix(line, "== ") {
			endPart()
			if m := reCheckPart.FindStringSubmatch(line); m != nil {
				part, lines = m[1], map[string]*LookupLine{}
			}
			continue
		}
		if part == "" || strings.TrimSpace(line) == "" {
			continue // gpu-check's summary of its parts: prose here
		}
		m := reCheckLookup.FindStringSubmatch(line)
		if m == nil {
			return nil, fmt.Errorf("%s:%d: a line of %s.txt must read \"alone|beside loads table|table-python|stand-in|daemon p50 X p99 Y max Z n N due D|- [GB/s G]\": %q", name, n, part, line)
		}
		if due != "" && m[5] != due {
			return nil, fmt.Errorf("%s:%d: due %s in %s.txt, whose earlier lines say due %s: a part is paced or back to back, not both", name, n, m[5], part, due)
		}
		due = m[5]
		situation := strings.Fields(m[1])[0]
		l, ok := lines[situation]
		if !ok {
			l = &LookupLine{Line: n, Situation: situation, BackToBack: due == "-"}
			lines[situation] = l
			order = append(order, situation)
		}
		// The raw lines say "table-python" where the rows say "python".
		dst := l.answer(strings.TrimPrefix(m[2], "table-"))
		if len(*dst) > 0 {
			return nil, fmt.Errorf("%s:%d: a second %s %s line in %s.txt", name, n, m[1], m[2], part)
		}
		p50, _ := strconv.ParseFloat(m[3], 64)
		p99, _ := strconv.ParseFloat(m[4], 64)
		*dst = append(*dst, P50P99{p50, p99})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	endPart()
	if len(c.Lookups) == 0 {
		return nil, fmt.Errorf("%s: no \"== lookups-NAME.txt\" section with lookup lines", name)
	}
	f.Calls = []Call{c}
	return f, nil
}
