package guest

import (
	"errors"
	"testing"
	"time"
)

func TestParseConfig(t *testing.T) {
	tests := []struct {
		in   string
		ok   bool
		want map[string]string
	}{
		{"", true, map[string]string{}},
		{"ttl=2h\n\n keys_per_file = 4 \n", true, map[string]string{"ttl": "2h", "keys_per_file": "4"}},
		{"a=b=c", true, map[string]string{"a": "b=c"}},
		{"novalue", false, nil},
	}
	for _, tt := range tests {
		c, err := ParseConfig([]byte(tt.in))
		if (err == nil) != tt.ok {
			t.Errorf("ParseConfig(%q) error %v, want ok=%v", tt.in, err, tt.ok)
			continue
		}
		for k, v := range tt.want {
			if got := c.String(k, "<unset>"); got != v {
				t.Errorf("ParseConfig(%q)[%s] = %q, want %q", tt.in, k, got, v)
			}
		}
	}
}

func TestConfigValues(t *testing.T) {
	c, _ := ParseConfig([]byte("n=12\nbad=x\nd=90s\nneg=-1s"))
	if n, err := c.Int("n", 0); err != nil || n != 12 {
		t.Errorf("Int(n) = %d, %v", n, err)
	}
	if n, err := c.Int("missing", 7); err != nil || n != 7 {
		t.Errorf("Int(missing) = %d, %v", n, err)
	}
	var ce *ConfigError
	if _, err := c.Int("bad", 0); !errors.As(err, &ce) || ce.Key != "bad" {
		t.Errorf("Int(bad) error %v", err)
	}
	if d, err := c.Duration("d", 0); err != nil || d != 90*time.Second {
		t.Errorf("Duration(d) = %v, %v", d, err)
	}
	if _, err := c.Duration("neg", 0); err == nil {
		t.Error("a negative duration was accepted")
	}
	round, err := ParseConfig(c.Encode())
	if err != nil || round.String("d", "") != "90s" || len(round.Keys()) != 4 {
		t.Errorf("Encode round trip: %v %v", round.Keys(), err)
	}
}

func TestCheckKeys(t *testing.T) {
	tests := []struct {
		in  string
		bad string // "" when every key is known
	}{
		{"ttl=2h\norder=block", ""},
		{"kvhost.shard=0\nkvhost.shards=4\nttl=1h", ""},
		{"ttll=2h", "ttll"},
		{"zz=1\naa=2", "aa"},
	}
	for _, tt := range tests {
		c, _ := ParseConfig([]byte(tt.in))
		err := c.CheckKeys("ttl", "order")
		var ce *ConfigError
		switch {
		case tt.bad == "" && err != nil:
			t.Errorf("CheckKeys(%q) = %v", tt.in, err)
		case tt.bad != "" && (!errors.As(err, &ce) || ce.Key != tt.bad):
			t.Errorf("CheckKeys(%q) = %v, want an error naming %q", tt.in, err, tt.bad)
		}
	}
}

// TestIntReadsDecimalAsAnOperatorWroteIt: a value is read in decimal, as
// the host writes TOML integers: a string value with a leading zero is
// its decimal number, not octal, and a prefix of another base is refused
// (ConfigError), never read in that base.
func TestIntReadsDecimalAsAnOperatorWroteIt(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		ok   bool
	}{
		{"12", 12, true},
		{"-3", -3, true},
		{"+4", 4, true},
		{"010", 10, true},
		{"0x10", 0, false},
		{"0b1", 0, false},
		{"1_000", 0, false},
	}
	for _, tt := range tests {
		c, _ := ParseConfig([]byte("n=" + tt.in))
		n, err := c.Int("n", 0)
		var ce *ConfigError
		if tt.ok && (err != nil || n != tt.want) || !tt.ok && !errors.As(err, &ce) {
			t.Errorf("Int(%q) = %d, %v; want %d, ok %v", tt.in, n, err, tt.want, tt.ok)
		}
	}
}
