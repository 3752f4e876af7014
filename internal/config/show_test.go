package config

import (
	"bytes"
	"math"
	"reflect"
	"strings"
	"testing"
)

// TestWriteTOMLReadsBack: what WriteTOML writes, Parse reads back to the
// same configuration, with the notes as comments on their keys' lines
// and unset pointers as comments.
func TestWriteTOMLReadsBack(t *testing.T) {
	tests := []struct {
		name  string
		src   string
		notes Notes
		want  []string // lines the output holds
	}{
		{name: "defaults", want: []string{`[server]`, `max_frame = "4MiB"`, `socket_mode = "0660"`, `restart_hold = "10s"`, `high_watermark = 0.95`, `# reuse_files: unset`}},
		{name: "notes", notes: Notes{"server.max_inflight_bytes": "derived", "mount.0.capacity": "90% of the file system"},
			want: []string{`max_inflight_bytes = "0"  # derived`, `capacity = "0"  # 90% of the file system`}},
		{name: "everything set", src: `
[server]
socket = "/run/kv \"x\".sock"
socket_mode = "0600"
max_inflight_bytes = 12345
[policy]
name = "sharded"
[policy.params]
depth = 2
ttl = "2h"
"odd key" = true
ratio = 1.5
[engine]
fsync = true
reuse_files = false
cpus = [0, 1]
[[mount]]
path = "/nvme/kv"
capacity = "100GiB"
high_watermark = 1
low_watermark = 0.5
checksum = false
preallocate = "4GiB"
[[mount]]
path = "/nvme/vllm"
layout = "vllm-fs"
[mount.vllm_fs]
namespace = "vllm:llama:0123"
row_bytes = "64KiB"
model_name = "m"
tokens_per_hash = 16
dtype = "bfloat16"
[[mount.vllm_fs.kv_cache_groups]]
tokens_per_block = 16
layer_names = ["a", "b"]
[[budget]]
model = "vllm:m_x:*"
bytes = "10GiB"
floor = "1GiB"
`, want: []string{`[[budget]]`, `model = "vllm:m_x:*"`, `bytes = "10GiB"`, `floor = "1GiB"`, `socket = "/run/kv \"x\".sock"`, `max_inflight_bytes = "12345"`, `"odd key" = true`, `ratio = 1.5`, `reuse_files = false`, `cpus = [0, 1]`,
			`high_watermark = 1.0`, `preallocate = "4GiB"`, `[mount.vllm_fs]`, `[[mount.vllm_fs.kv_cache_groups]]`, `layer_names = ["a", "b"]`}},
		{name: "infinite parameters and an odd path", src: `
[policy.params]
high = inf
low = -inf
huge = 1e300
[[mount]]
path = "/nvme/a\tb \"c\" \\d é\u007f"
`, want: []string{`high = inf`, `low = -inf`, `huge = 1e+300`, `path = "/nvme/a\u0009b \"c\" \\d é\u007F"`}},
		{name: "a parameter that is not a number", src: "[policy.params]\nundefined = nan\n", want: []string{`undefined = nan`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse("in.toml", []byte(tt.src))
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			if err := c.WriteTOML(&out, tt.notes); err != nil {
				t.Fatal(err)
			}
			back, err := Parse("out.toml", out.Bytes())
			if err != nil {
				t.Fatalf("the output does not read back: %v\n%s", err, out.String())
			}
			if v, ok := c.Policy.Params["undefined"].(float64); ok && math.IsNaN(v) {
				// NaN equals nothing: read back, it must be NaN again.
				if w, ok := back.Policy.Params["undefined"].(float64); !ok || !math.IsNaN(w) {
					t.Fatalf("nan read back as %v", back.Policy.Params["undefined"])
				}
				delete(back.Policy.Params, "undefined")
				delete(c.Policy.Params, "undefined")
			}
			if !reflect.DeepEqual(back, c) {
				t.Fatalf("read back:\n%+v\nwant:\n%+v\nfrom:\n%s", back, c, out.String())
			}
			lines := strings.Split(out.String(), "\n")
			for _, w := range tt.want {
				found := false
				for _, l := range lines {
					if strings.HasPrefix(l, w) {
						found = true
						break
					}
				}
				if !found {
					t.Errorf("no line begins with %q in:\n%s", w, out.String())
				}
			}
		})
	}
}
