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
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/internal/config"
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

// unitService returns the [Service] settings of a systemd unit file, each
// key's values in order.
func unitService(t *testing.T, path string) map[string][]string {
	t.Helper()
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	section := ""
	for _, l := range strings.Split(string(src), "\n") {
		l = strings.TrimSpace(l)
		switch {
		case l == "" || strings.HasPrefix(l, "#") || strings.HasPrefix(l, ";"):
		case strings.HasPrefix(l, "["):
			section = strings.Trim(l, "[]")
		case section == "Service":
			if k, v, ok := strings.Cut(l, "="); ok {
				out[strings.TrimSpace(k)] = append(out[strings.TrimSpace(k)], strings.TrimSpace(v))
			}
		}
	}
	return out
}

// last is the value a systemd setting takes: its last assignment, or def.
func last(vals []string, def string) string {
	if len(vals) == 0 {
		return def
	}
	return vals[len(vals)-1]
}

// TestSystemdSocketReachableByClientGroup plays systemd's and the daemon's
// part in making the socket of deploy/systemd: systemd creates each
// RuntimeDirectory owned by User:Group with RuntimeDirectoryMode (0755
// when unset); the daemon, running as User with Group and its
// SupplementaryGroups, makes the socket with socket_mode and
// socket_group. A worker whose only group is socket_group must then be
// able to search every directory kvhost did not create and write the
// socket; and the daemon must be a member of socket_group to give it the
// socket.
func TestSystemdSocketReachableByClientGroup(t *testing.T) {
	dir := filepath.Join("..", "..", "deploy", "systemd")
	svc := unitService(t, filepath.Join(dir, "kvhost.service"))
	cfg, err := config.Load(filepath.Join(dir, "kvhost.toml"))
	if err != nil {
		t.Fatal(err)
	}
	user, group := last(svc["User"], "root"), last(svc["Group"], last(svc["User"], "root"))
	var daemonGroups []string
	daemonGroups = append(daemonGroups, group)
	for _, v := range svc["SupplementaryGroups"] {
		daemonGroups = append(daemonGroups, strings.Fields(v)...)
	}
	clientGroup := cfg.Server.SocketGroup
	if clientGroup == "" {
		t.Fatalf("kvhost.toml: server.socket_group is empty: the socket would belong to the daemon's group %s", group)
	}
	if clientGroup == group || user == "root" {
		t.Fatalf("the daemon runs as %s:%s; the test wants a client group apart from the daemon's own", user, group)
	}
	found := false
	for _, g := range daemonGroups {
		found = found || g == clientGroup
	}
	if !found {
		t.Errorf("socket_group %s is not among the daemon's groups %v (Group, SupplementaryGroups): it cannot give the socket that group", clientGroup, daemonGroups)
	}
	mode, err := strconv.ParseUint(last(svc["RuntimeDirectoryMode"], "0755"), 8, 32)
	if err != nil {
		t.Fatal(err)
	}
	var runDirs []string
	for _, v := range svc["RuntimeDirectory"] {
		for _, d := range strings.Fields(v) {
			runDirs = append(runDirs, filepath.Join("/run", d))
		}
	}
	sock := cfg.Server.Socket
	parent := filepath.Dir(sock)
	if !slices.Contains(runDirs, parent) {
		t.Fatalf("socket %s is not directly in a RuntimeDirectory %v", sock, runDirs)
	}
	// The client is neither the owner nor in the directory's group:
	// search needs the "other" x bit.
	if mode&0o001 == 0 {
		t.Errorf("RuntimeDirectory %s is %s:%s mode %04o: a worker in group %s only cannot search it (permission denied on %s)", parent, user, group, mode, clientGroup, sock)
	}
	// The socket: owned by user:socket_group, socket_mode; connecting
	// needs write permission, through the group bits.
	if m := uint32(cfg.Server.SocketMode); m&0o020 == 0 {
		t.Errorf("socket_mode %04o: group %s cannot write (connect to) the socket", m, clientGroup)
	}
}

// dockerfile is what the tests read of deploy/docker/Dockerfile: its ARG
// defaults, its final USER, and the lines of its leading comment.
type dockerfile struct {
	args    map[string]string
	user    string
	comment []string
}

func readDockerfile(t *testing.T) dockerfile {
	t.Helper()
	src, err := os.ReadFile(filepath.Join("..", "..", "deploy", "docker", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	d := dockerfile{args: map[string]string{}}
	inComment := true
	for _, l := range strings.Split(string(src), "\n") {
		if inComment && strings.HasPrefix(l, "#") {
			d.comment = append(d.comment, strings.TrimSpace(strings.TrimPrefix(l, "#")))
			continue
		}
		inComment = false
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		switch f[0] {
		case "ARG":
			if k, v, ok := strings.Cut(f[1], "="); ok {
				d.args[k] = v
			}
		case "USER":
			d.user = f[1]
		}
	}
	return d
}

// TestDockerBaseImageHasCUDARuntime checks that the image is built on an
// nvidia/cuda runtime image (Debian or Ubuntu: the user commands are
// Debian's), so that the image can use a GPU without the NVIDIA container
// toolkit mounting a runtime.
func TestDockerBaseImageHasCUDARuntime(t *testing.T) {
	d := readDockerfile(t)
	re := regexp.MustCompile(`^(docker\.io/)?nvidia/cuda:\d+\.\d+(\.\d+)?-(cudnn\d*-)?runtime-(ubuntu|debian)[0-9.]+$`)
	if base := d.args["BASE"]; !re.MatchString(base) {
		t.Errorf("ARG BASE=%s: want an nvidia/cuda runtime image on Ubuntu or Debian (nvidia/cuda:X.Y.Z-runtime-ubuntuNN.NN)", base)
	}
}

// TestDockerRunHostDirectoriesWritableByImageUser checks the documented
// docker run: every host directory it mounts must be given, by a
// documented command before it, to the user the container runs as (the
// image's USER, or the run's --user), since docker creates missing
// directories owned by root.
func TestDockerRunHostDirectoriesWritableByImageUser(t *testing.T) {
	d := readDockerfile(t)
	// The documented command: "docker run" and its continuation lines.
	var run []string
	start := -1
	for i, l := range d.comment {
		if strings.HasPrefix(l, "docker run") {
			start = i
			for j := i; j < len(d.comment); j++ {
				run = append(run, strings.Fields(strings.TrimSuffix(d.comment[j], "\\"))...)
				if !strings.HasSuffix(d.comment[j], "\\") {
					break
				}
			}
			break
		}
	}
	if start < 0 {
		t.Fatal("the Dockerfile documents no docker run")
	}
	runAs := d.user
	var hostDirs []string
	for i, a := range run {
		switch {
		case a == "--user" && i+1 < len(run):
			runAs = run[i+1]
		case a == "-v" && i+1 < len(run):
			host, _, _ := strings.Cut(run[i+1], ":")
			if strings.HasPrefix(host, "/") {
				hostDirs = append(hostDirs, host)
			}
		}
	}
	uid, _, _ := strings.Cut(runAs, ":")
	if uid == "" || uid == "0" || uid == "root" {
		t.Fatalf("the container runs as %q: want an unprivileged user", runAs)
	}
	if len(hostDirs) == 0 {
		t.Fatal("the documented docker run mounts no host directory")
	}
	// A directory is given to uid by "install -d -o UID ... DIR" or
	// "chown UID[:GID] DIR" before the docker run.
	owned := map[string]bool{}
	for _, l := range d.comment[:start] {
		f := strings.Fields(strings.TrimPrefix(l, "sudo "))
		if len(f) < 3 {
			continue
		}
		switch f[0] {
		case "install":
			if slices.Contains(f, "-d") {
				if i := slices.Index(f, "-o"); i >= 0 && i+1 < len(f) && f[i+1] == uid {
					for _, a := range f[1:] {
						owned[a] = true
					}
				}
			}
		case "chown":
			if u, _, _ := strings.Cut(f[len(f)-2], ":"); u == uid || strings.HasPrefix(f[1], uid) {
				owned[f[len(f)-1]] = true
			}
		}
	}
	for _, h := range hostDirs {
		if !owned[h] {
			t.Errorf("docker run mounts %s, which no documented command before it gives to uid %s (the container's user): kvhost stops with mkdir ...: permission denied", h, uid)
		}
	}
}

// TestVLLMImageInstallsTheClientOfThisRepository: the vLLM image of
// deploy/docker/vllm.Dockerfile copies the repository's Python client
// (a directory with its pyproject.toml) and pip-installs what it copied,
// checking that kvhost.vllm imports; docs/vllm.md's pod runs the image it
// builds.
func TestVLLMImageInstallsTheClientOfThisRepository(t *testing.T) {
	root := filepath.Join("..", "..")
	src, err := os.ReadFile(filepath.Join(root, "deploy", "docker", "vllm.Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	var from, to, install string
	for _, l := range strings.Split(string(src), "\n") {
		f := strings.Fields(l)
		switch {
		case len(f) == 3 && f[0] == "COPY":
			from, to = f[1], f[2]
		case len(f) > 1 && f[0] == "RUN":
			install = l
		}
	}
	if _, err := os.Stat(filepath.Join(root, from, "pyproject.toml")); err != nil || to == "" {
		t.Fatalf("COPY %s %s: want the repository's client directory: %v", from, to, err)
	}
	if !strings.Contains(install, "pip install") || !strings.Contains(install, " "+to) || !strings.Contains(string(src), `import kvhost.vllm`) {
		t.Fatalf("RUN %q: want a pip install of %s, then an import of kvhost.vllm", install, to)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "vllm.md"))
	if err != nil {
		t.Fatal(err)
	}
	const build = "docker build -f deploy/docker/vllm.Dockerfile -t vllm-kvhost:dev ."
	if !strings.Contains(string(doc), build) || !strings.Contains(string(doc), "image: vllm-kvhost:dev") || !strings.Contains(string(src), build) {
		t.Fatalf("docs/vllm.md and the Dockerfile should both give %q, and the pod run image vllm-kvhost:dev", build)
	}
}

// readRepoFile is the repository's file rel, failing t where it cannot
// be read.
func readRepoFile(t *testing.T, rel ...string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(append([]string{"..", ".."}, rel...)...))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// makeVar is the default of the Makefile's variable name (NAME ?= or
// NAME :=), "" where it has none.
func makeVar(makefile, name string) string {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\s*[?:]?=\s*(.*)$`).FindStringSubmatch(makefile)
	if m == nil {
		return ""
	}
	return strings.TrimSpace(m[1])
}

// TestDeployFilesNameWhatTheBuildMakes: the manifests ran
// ghcr.io/kvhost/kvhost:latest, which nothing built; the vLLM image
// extended vllm/vllm-openai:latest and set no KVHOST_SOCKET; the unit's
// Documentation= named a file nothing installed; the build context took
// in .cache (108 MB). Now: every kvhost container of the manifests runs
// the image `make image` tags; the vLLM image is a release tag and sets
// KVHOST_SOCKET to the daemon image's socket; the unit's documentation is
// a file `make install` installs under the prefix its ExecStart runs
// from; .dockerignore keeps the caches, outputs and history out.
func TestDeployFilesNameWhatTheBuildMakes(t *testing.T) {
	makefile := readRepoFile(t, "Makefile")
	image := makeVar(makefile, "IMAGE")
	if image == "" || !strings.Contains(makefile, "-t $(IMAGE) .") {
		t.Fatalf("the Makefile's image target does not tag IMAGE (default %q)", image)
	}
	for _, m := range []string{"kvhost-daemonset.yaml", "kvhost-daemonset-shared.yaml"} {
		src := readRepoFile(t, "deploy", "kubernetes", m)
		images := regexp.MustCompile(`(?m)^\s*image:\s*(\S+)`).FindAllStringSubmatch(src, -1)
		found := false
		for _, im := range images {
			if strings.Contains(im[1], "kvhost") {
				found = true
				if im[1] != image {
					t.Errorf("%s runs %s; want %s, the image make image builds", m, im[1], image)
				}
			}
		}
		if !found || !strings.Contains(src, "make image") {
			t.Errorf("%s runs no kvhost image, or does not say how to build it (make image)", m)
		}
	}

	vllm := readRepoFile(t, "deploy", "docker", "vllm.Dockerfile")
	if m := regexp.MustCompile(`(?m)^ARG VLLM_IMAGE=vllm/vllm-openai:v\d+\.\d+\.\d+$`).FindString(vllm); m == "" {
		t.Errorf("vllm.Dockerfile: want ARG VLLM_IMAGE=vllm/vllm-openai:vX.Y.Z, a release tag")
	}
	cfg, err := config.Load(filepath.Join("..", "..", "deploy", "docker", "kvhost.toml"))
	if err != nil {
		t.Fatal(err)
	}
	if want := "ENV KVHOST_SOCKET=" + cfg.Server.Socket + "\n"; !strings.Contains(vllm, want) {
		t.Errorf("vllm.Dockerfile lacks %q (the daemon image's socket)", strings.TrimSpace(want))
	}

	unit := readRepoFile(t, "deploy", "systemd", "kvhost.service")
	doc := regexp.MustCompile(`(?m)^Documentation=file://(\S+)$`).FindStringSubmatch(unit)
	exec := regexp.MustCompile(`(?m)^ExecStart=(\S+)/bin/kvhost `).FindStringSubmatch(unit)
	if doc == nil || exec == nil {
		t.Fatalf("the unit has no Documentation=file://... or ExecStart=PREFIX/bin/kvhost")
	}
	installed := strings.Fields(makeVar(makefile, "INSTALL_DOCS"))
	if dir, file := filepath.Split(doc[1]); dir != exec[1]+"/share/doc/kvhost/" || !slices.ContainsFunc(installed, func(f string) bool { return filepath.Base(f) == file }) {
		t.Errorf("Documentation=file://%s: want a file of INSTALL_DOCS (%v) under %s/share/doc/kvhost, where make install puts them", doc[1], installed, exec[1])
	}

	ignore := strings.Fields(readRepoFile(t, ".dockerignore"))
	for _, p := range []string{".git", ".cache", "bin", "gpu-bins"} {
		if !slices.Contains(ignore, p) {
			t.Errorf(".dockerignore does not exclude %s", p)
		}
	}
	for _, p := range ignore {
		if p == "plugins" || strings.HasPrefix(p, "plugins/wasm") || p == "*.wasm" {
			t.Errorf(".dockerignore excludes %s: the image's build embeds the committed plugins/wasm", p)
		}
	}
}
