package main

import (
	"strings"
	"testing"
)

func TestGPUUUIDIsWrittenAsNvidiaSmiWritesIt(t *testing.T) {
	cases := []struct {
		name string
		uuid [16]byte
		want string
	}{
		{"unknown", [16]byte{}, ""},
		{"an H200", [16]byte{0xb5, 0x2f, 0x41, 0x89, 0x5e, 0x10, 0x38, 0x62, 0xc8, 0xb5, 0x0e, 0x94, 0x47, 0xd3, 0x8f, 0x9f},
			"GPU-b52f4189-5e10-3862-c8b5-0e9447d38f9f"},
	}
	for _, c := range cases {
		if got := gpuUUID(c.uuid); got != c.want {
			t.Errorf("%s: gpuUUID = %q, want %q", c.name, got, c.want)
		}
	}
}

// TestHealthFailsOnAFallenBackPolicyOrABrokenGPU: `kvhost health` judges
// the daemon's Stats: a GPU with a job that failed on a sticky CUDA error
// (its context broken until the daemon restarts) makes it unhealthy, so
// that a liveness probe restarts it, unless --allow-device-faults; a
// fallen-back policy only with --allow-fallback=false.
func TestHealthFailsOnAFallenBackPolicyOrABrokenGPU(t *testing.T) {
	healthy := statsReport{Devices: []statsDevice{{Ordinal: 0}, {Ordinal: 1}}}
	broken := statsReport{Devices: []statsDevice{{Ordinal: 0}, {Ordinal: 1, Faults: 2}}}
	fellBack := statsReport{}
	fellBack.Policy.Name, fellBack.Policy.Fallback, fellBack.Policy.FallbackReason = "lfu", true, "trap"
	for _, tc := range []struct {
		name                       string
		r                          statsReport
		allowFallback, allowFaults bool
		want                       string // in the reason; "" for healthy
	}{
		{"healthy GPUs", healthy, false, false, ""},
		{"no GPU", statsReport{}, false, false, ""},
		{"a broken GPU", broken, true, false, "2 device faults on GPU 1 (jobs or registrations that failed with a sticky CUDA error"},
		{"a broken GPU, faults allowed", broken, true, true, ""},
		{"a fallen-back policy", fellBack, false, false, "the policy lfu fell back to its native fallback: trap"},
		{"a fallen-back policy, allowed", fellBack, true, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := unhealthy(tc.r, tc.allowFallback, tc.allowFaults)
			if tc.want == "" && got != "" || !strings.Contains(got, tc.want) {
				t.Fatalf("unhealthy = %q, want %q", got, tc.want)
			}
		})
	}
}
