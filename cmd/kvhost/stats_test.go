package main

import "testing"

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
