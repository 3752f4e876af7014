package conformance

import (
	"encoding/json"
	"io"
	"time"
)

// jsonReport is the JSON form of a Report (`kvhost policy test --json`):
// durations in microseconds, feature bits both as a number and as names.
type jsonReport struct {
	Plugin     string       `json:"plugin"`
	OK         bool         `json:"ok"`
	Passed     int          `json:"passed"`
	Failed     int          `json:"failed"`
	Module     jsonModule   `json:"module"`
	DeadlineUS int64        `json:"deadline_us"`
	Checks     []jsonCheck  `json:"checks"`
	Timing     []jsonTiming `json:"timing"`
	Stats      *jsonStats   `json:"stats,omitempty"`
}

type jsonModule struct {
	Size         int      `json:"size"`
	ABIVersion   int32    `json:"abi_version"`
	VersionKnown bool     `json:"abi_version_known"`
	Features     uint64   `json:"features"`
	FeatureNames string   `json:"feature_names"`
	Hooks        []string `json:"hooks"`
	Imports      []string `json:"imports"`
	Problems     []string `json:"problems"`
}

type jsonCheck struct {
	Name       string `json:"name"`
	OK         bool   `json:"ok"`
	Rule       string `json:"rule"`
	Message    string `json:"message"`
	DurationUS int64  `json:"duration_us"`
}

type jsonTiming struct {
	Hook         string  `json:"hook"`
	Calls        int     `json:"calls"`
	Records      int     `json:"records"`
	P50US        float64 `json:"p50_us"`
	P99US        float64 `json:"p99_us"`
	MaxUS        float64 `json:"max_us"`
	P99Deadline  float64 `json:"p99_of_deadline"`
	OverDeadline int     `json:"over_deadline"`
}

type jsonStats struct {
	Calls          map[string]uint64 `json:"calls"`
	Records        map[string]uint64 `json:"records"`
	Failures       uint64            `json:"failures"`
	Rejections     uint64            `json:"rejections"`
	Replacements   uint64            `json:"replacements"`
	StaleVictims   uint64            `json:"stale_victims"`
	SlowCalls      uint64            `json:"slow_calls"`
	Fallback       bool              `json:"fallback"`
	FallbackReason string            `json:"fallback_reason,omitempty"`
	Backend        string            `json:"backend"`
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// WriteJSON writes the report as one indented JSON object, for vendors' CI:
// the verdict, the module, every check with its rule, the call times per
// hook and the host's counters.
func (r Report) WriteJSON(w io.Writer) error {
	j := jsonReport{Plugin: r.Plugin, OK: r.OK(), DeadlineUS: r.Deadline.Microseconds(),
		Module: jsonModule{Size: r.Info.Size, ABIVersion: r.Info.ABIVersion, VersionKnown: r.Info.VersionKnown,
			Features: uint64(r.Info.Features), FeatureNames: r.Info.Features.String(),
			Hooks: nonNil(r.Info.Hooks), Imports: nonNil(r.Info.Imports), Problems: nonNil(r.Info.Problems)},
		Checks: []jsonCheck{}, Timing: []jsonTiming{}}
	for _, c := range r.Checks {
		if c.OK {
			j.Passed++
		} else {
			j.Failed++
		}
		j.Checks = append(j.Checks, jsonCheck{Name: c.Name, OK: c.OK, Rule: c.Rule, Message: c.Message, DurationUS: c.Duration.Microseconds()})
	}
	for _, t := range r.Timing {
		jt := jsonTiming{Hook: t.Hook, Calls: t.Calls, Records: t.Records, P50US: us(t.P50), P99US: us(t.P99), MaxUS: us(t.Max),
			OverDeadline: t.OverDeadline}
		if r.Deadline > 0 {
			jt.P99Deadline = float64(t.P99) / float64(r.Deadline)
		}
		j.Timing = append(j.Timing, jt)
	}
	if r.HasStats {
		st := r.Stats
		j.Stats = &jsonStats{Calls: st.Calls, Records: st.Records, Failures: st.Failures, Rejections: st.Rejections,
			Replacements: st.Replacements, StaleVictims: st.StaleVictims, SlowCalls: st.SlowCalls,
			Fallback: st.Fallback, FallbackReason: st.FallbackReason, Backend: st.Backend}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(j)
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
