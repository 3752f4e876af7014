package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestBadParamsOfTheBuiltInPolicyAreNamedNotAFailedModule: a typo in
// [policy.params] of the built-in lru stops the daemon with the plugin's
// refusal; it is not reported as the wasm module failing to load, nor
// tried again with the native build (which would refuse the same).
func TestBadParamsOfTheBuiltInPolicyAreNamedNotAFailedModule(t *testing.T) {
	dir := t.TempDir()
	file, _, _ := testConfig(t, dir, "[gpu]\nmode = \"off\"\n\n[policy.params]\nkeys_per_fil = 8")
	out, err := exec.Command(kvhostBinary(t), "--config", file).CombinedOutput()
	if err == nil {
		t.Fatalf("the daemon started with a bad policy parameter:\n%s", out)
	}
	log := string(out)
	if !strings.Contains(log, "keys_per_fil") || !strings.Contains(log, "kvhost_init") {
		t.Errorf("the daemon's output does not name the parameter the plugin refused:\n%s", log)
	}
	if strings.Contains(log, "running its native build") {
		t.Errorf("a refused parameter was reported as the wasm module failing to load:\n%s", log)
	}
}
