package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/config"
)

// invocation is a kvhost command line found in a deployment file.
type invocation struct {
	where string   // file:line
	args  []string // after the program name
}

var (
	jsonArray   = regexp.MustCompile(`\[.*\]`)
	yamlCommand = regexp.MustCompile(`^\s*(-\s+)?command:\s*(\[.*\])\s*$`)
	yamlArgs    = regexp.MustCompile(`^\s*args:\s*(\[.*\])\s*$`)
)

// isKvhost reports whether a program path names the kvhost binary.
func isKvhost(prog string) bool { return filepath.Base(prog) == "kvhost" }

// deployInvocations extracts the kvhost command lines of a deployment
// file: ExecStart/ExecReload of systemd units, ENTRYPOINT+CMD, HEALTHCHECK
// and RUN of Dockerfiles, command(+args) arrays of Kubernetes manifests.
func deployInvocations(t *testing.T, path string) []invocation {
	t.Helper()
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(src), "\n")
	var out []invocation
	add := func(n int, argv []string) {
		if len(argv) > 0 && isKvhost(argv[0]) {
			out = append(out, invocation{where: path + ":" + itoa(n+1), args: argv[1:]})
		}
	}
	parseArray := func(n int, s string) []string {
		var a []string
		if err := json.Unmarshal([]byte(s), &a); err != nil {
			t.Fatalf("%s:%d: %q is not a JSON array: %v", path, n+1, s, err)
		}
		return a
	}
	base := filepath.Base(path)
	switch {
	case strings.HasSuffix(base, ".service"):
		for n, l := range lines {
			if k, v, ok := strings.Cut(l, "="); ok && strings.HasPrefix(k, "Exec") {
				add(n, strings.Fields(strings.TrimLeft(v, "-@+!")))
			}
		}
	case base == "Dockerfile":
		var entry []string
		entryLine := 0
		for n, l := range lines {
			f := strings.Fields(l)
			if len(f) == 0 {
				continue
			}
			switch f[0] {
			case "ENTRYPOINT":
				entry, entryLine = parseArray(n, jsonArray.FindString(l)), n
			case "CMD":
				add(entryLine, append(append([]string{}, entry...), parseArray(n, jsonArray.FindString(l))...))
			case "HEALTHCHECK":
				_, after, _ := strings.Cut(l, " CMD ")
				add(n, parseArray(n, after))
			}
			// Shell commands (RUN and its continuations) running the
			// freshly built binary.
			for _, part := range strings.Split(l, "&&") {
				fs := strings.Fields(strings.TrimSuffix(strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(part), "RUN")), "\\"))
				if len(fs) > 0 && strings.HasSuffix(fs[0], "bin/kvhost") {
					add(n, fs)
				}
			}
		}
	case strings.HasSuffix(base, ".yaml"), strings.HasSuffix(base, ".yml"):
		for n, l := range lines {
			m := yamlCommand.FindStringSubmatch(l)
			if m == nil {
				continue
			}
			argv := parseArray(n, m[2])
			if n+1 < len(lines) {
				if a := yamlArgs.FindStringSubmatch(lines[n+1]); a != nil {
					argv = append(argv, parseArray(n+1, a[1])...)
				}
			}
			add(n, argv)
		}
	}
	return out
}

func itoa(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// embeddedTOML returns the block scalars under `kvhost.toml: |` of a YAML
// file.
func embeddedTOML(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	var cur *strings.Builder
	indent := -1
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := sc.Text()
		if cur != nil {
			trimmed := strings.TrimLeft(l, " ")
			depth := len(l) - len(trimmed)
			if trimmed != "" && indent < 0 {
				indent = depth
			}
			if trimmed == "" || depth >= indent {
				if len(l) >= indent && indent >= 0 {
					cur.WriteString(l[min(indent, len(l)):])
				}
				cur.WriteString("\n")
				continue
			}
			out = append(out, cur.String())
			cur = nil
		}
		if strings.HasSuffix(strings.TrimSpace(l), "kvhost.toml: |") {
			cur, indent = &strings.Builder{}, -1
		}
	}
	if cur != nil {
		out = append(out, cur.String())
	}
	return out, sc.Err()
}

// checkInvocation runs an invocation's arguments through kvhost's own
// flag sets: serve's flags are parsed by config.BindFlags' set; every
// other command runs with them against no daemon (it must not fail with
// a usage error, exit 2). Paths of configuration files inside the image or
// host are replaced by local, the configuration shipped next to the file.
func checkInvocation(t *testing.T, inv invocation, local string) {
	t.Helper()
	args := append([]string(nil), inv.args...)
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		args = append([]string{"serve"}, args...)
	}
	if _, ok := commands()[args[0]]; !ok {
		t.Errorf("%s: kvhost %s: no such command", inv.where, args[0])
		return
	}
	if args[0] == "serve" {
		fs := flag.NewFlagSet("kvhost serve", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		flags := config.BindFlags(fs)
		if err := fs.Parse(args[1:]); err != nil {
			t.Errorf("%s: kvhost %s: %v", inv.where, strings.Join(args, " "), err)
			return
		}
		if fs.NArg() > 0 {
			t.Errorf("%s: kvhost serve: unexpected argument %q", inv.where, fs.Arg(0))
		}
		if flags.ConfigPath() != "" {
			if local == "" {
				t.Errorf("%s: --config %s, but no configuration ships with it", inv.where, flags.ConfigPath())
				return
			}
			if err := fs.Set("config", local); err != nil {
				t.Fatal(err)
			}
			if _, err := flags.Load(); err != nil {
				t.Errorf("%s: kvhost %s: %v", inv.where, strings.Join(args, " "), err)
			}
		}
		return
	}
	for i, a := range args {
		if strings.HasSuffix(a, ".toml") && local != "" {
			args[i] = local
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var errb strings.Builder
	if code := run(ctx, args, io.Discard, &errb); code == 2 {
		t.Errorf("%s: kvhost %s: usage error: %s", inv.where, strings.Join(args, " "), errb.String())
	}
}

// TestDeployFilesUseRealFlagsAndValidConfigs checks every deployment file
// under deploy/: each kvhost command line in them names a command and
// flags kvhost has (parsed by its own flag sets), every configuration file
// there and every configuration embedded in a manifest passes config.Load,
// and the flags of the serve lines load with the configuration shipped
// next to them.
func TestDeployFilesUseRealFlagsAndValidConfigs(t *testing.T) {
	root := filepath.Join("..", "..", "deploy")
	kinds := map[string]int{}
	invocations := 0
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		base := filepath.Base(path)
		dir := filepath.Dir(path)
		local := filepath.Join(dir, "kvhost.toml")
		if _, err := os.Stat(local); err != nil {
			local = ""
		}
		switch {
		case strings.HasSuffix(base, ".toml"):
			if _, err := config.Load(path); err != nil {
				t.Errorf("%s: %v", path, err)
			}
			kinds["toml"]++
		case strings.HasSuffix(base, ".yaml"):
			docs, err := embeddedTOML(path)
			if err != nil {
				return err
			}
			if len(docs) == 0 {
				t.Errorf("%s: no embedded kvhost.toml", path)
			}
			for i, src := range docs {
				if _, err := config.Parse(path+" (kvhost.toml "+itoa(i)+")", []byte(src)); err != nil {
					t.Errorf("%v", err)
				}
				f := filepath.Join(t.TempDir(), "kvhost.toml")
				if err := os.WriteFile(f, []byte(src), 0o644); err != nil {
					return err
				}
				local = f
			}
		}
		invs := deployInvocations(t, path)
		for _, inv := range invs {
			checkInvocation(t, inv, local)
		}
		if len(invs) > 0 {
			switch {
			case strings.HasSuffix(base, ".service"):
				kinds["unit"]++
			case strings.HasSuffix(base, ".yaml"):
				kinds["manifest"]++
			case base == "Dockerfile":
				kinds["dockerfile"]++
			}
		}
		invocations += len(invs)
		t.Logf("%s: %d kvhost command lines", path, len(invs))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// The unit, the manifest and the Dockerfile each run kvhost; at least
	// serve, health and config check are among them.
	if invocations < 6 || kinds["unit"] == 0 || kinds["manifest"] == 0 || kinds["dockerfile"] == 0 || kinds["toml"] < 2 {
		t.Fatalf("found %d kvhost command lines, files %v: want a systemd unit, a manifest and a Dockerfile that run kvhost", invocations, kinds)
	}
}
