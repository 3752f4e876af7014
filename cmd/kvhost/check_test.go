package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/engine"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/cuda/cudatest"
	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/daemon/daemontest"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/internal/vllmfs"
)

// runCheckCmd runs kvhost check and returns its exit code and output.
func runCheckCmd(t *testing.T, args ...string) (int, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), append([]string{"check"}, args...), &stdout, &stderr)
	return code, stdout.String() + stderr.String()
}

func TestCheckWithoutAGPUWarnsWithAFixAndPasses(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "nothing.so")
	code, out := runCheckCmd(t, "--dir", dir, "--cuda-library", missing, "--cufile-library", missing)
	if code != 0 {
		t.Fatalf("exit %d without a GPU, want 0 (host memory still works):\n%s", code, out)
	}
	for _, want := range []string{
		"WARN  gpu       no CUDA runtime", "fix: install the NVIDIA driver",
		"INFO  cufile    cuFile unavailable",
		"OK    " + dir + "  file system", "free",
		"O_DIRECT", "kvhost check: ",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

func TestCheckGPUModeOnWithoutAGPUFails(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "kvhost.toml")
	body := "[gpu]\nmode = \"on\"\ncuda_library = \"" + filepath.Join(dir, "nothing.so") + "\"\n\n[[mount]]\npath = \"" + dir + "\"\n"
	if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out := runCheckCmd(t, "--config", cfg)
	if code != 1 || !strings.Contains(out, "FAIL  gpu       no CUDA runtime") {
		t.Fatalf("exit %d; want 1 with a FAIL line for the GPU the configuration requires:\n%s", code, out)
	}
}

func TestCheckWithFakeLibrariesReportsDevicesCuFileAndRegistration(t *testing.T) {
	cudaLib, cufileLib := cudatest.Build(t), daemontest.BuildFakeCuFile(t)
	dir := t.TempDir()
	code, out := runCheckCmd(t, "--dir", dir, "--cuda-library", cudaLib, "--cufile-library", cufileLib)
	if code != 0 {
		t.Fatalf("exit %d:\n%s", code, out)
	}
	for _, want := range []string{
		"OK    gpu       CUDA runtime " + cudaLib,
		"OK    gpu       device 0:",
		"OK    cufile    cuFile " + cufileLib + ", version 1.15.1",
		"nvidia-fs",
		"compatibility mode allowed: yes",
		"cuFile registers files",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

func TestCheckSpeedJSONMeasuresEveryTest(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "nothing.so")
	code, out := runCheckCmd(t, "--dir", dir, "--cuda-library", missing, "--cufile-library", missing, "--speed", "--speed-size", "2MiB", "--json")
	if code != 0 {
		t.Fatalf("exit %d:\n%s", code, out)
	}
	var rep checkReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, out)
	}
	if rep.Schema != checkSchema || rep.Warn == 0 || rep.OK == 0 || rep.Fail != 0 || len(rep.Items) != rep.OK+rep.Warn+rep.Fail+countInfo(rep.Items) {
		t.Errorf("report counts %+v", rep)
	}
	if len(rep.Speed) != 2 && len(rep.Speed) != 4 {
		t.Fatalf("%d speed results, want write and read, buffered (and O_DIRECT where supported): %+v", len(rep.Speed), rep.Speed)
	}
	for _, s := range rep.Speed {
		if s.Bytes != 2<<20 || s.GBps <= 0 || s.Mount != dir {
			t.Errorf("speed %+v: want 2 MiB moved at a positive rate", s)
		}
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Errorf("the speed test left %d files", len(left))
	}
}

func countInfo(items []checkItem) int {
	n := 0
	for _, it := range items {
		if it.Level == levelInfo {
			n++
		}
	}
	return n
}

func TestCheckMountProblemsAreNamed(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "nothing.so")
	cases := []struct {
		dir, want string
		code      int
	}{
		{file, "FAIL  " + file + "  is not a directory", 1},
		{filepath.Join(dir, "later", "blocks"), "WARN  " + filepath.Join(dir, "later", "blocks") + "  does not exist; kvhost creates it", 0},
	}
	for _, c := range cases {
		code, out := runCheckCmd(t, "--dir", c.dir, "--cuda-library", missing, "--cufile-library", missing)
		if code != c.code || !strings.Contains(out, c.want) {
			t.Errorf("check --dir %s: exit %d, want %d and %q:\n%s", c.dir, code, c.code, c.want, out)
		}
	}
}

func TestSpaceFinding(t *testing.T) {
	const gib = 1 << 30
	cases := []struct {
		name                           string
		size, avail, capacity, reserve int64
		level, want                    string
	}{
		{"plenty", 100 * gib, 95 * gib, 10 * gib, 0, levelOK, "capacity 10 GiB, configured 10 GiB, reserve 0 B: fits"},
		{"default capacity, mostly used", 100 * gib, 20 * gib, 0, 0, levelInfo, "capacity 20 GiB now, configured 90 GiB, reserve 0 B: only 20 GiB can be stored now"},
		{"reserve eats the rest", 100 * gib, 5 * gib, 0, 5 * gib, levelWarn, "full for kvhost"},
		{"disk full", 100 * gib, 0, 10 * gib, 0, levelWarn, "stores fail with no space"},
		{"capacity beyond the disk", 100 * gib, 90 * gib, 200 * gib, 0, levelWarn, "exceeds the file system's size"},
	}
	for _, c := range cases {
		level, what, _ := spaceFinding(c.size, c.avail, c.capacity, c.reserve)
		if level != c.level || !strings.Contains(what, c.want) {
			t.Errorf("%s: %s %q; want %s containing %q", c.name, level, what, c.level, c.want)
		}
	}
}

// TestHugePagesJudgementNamesWhatTheKernelGives: a tmpfs whose stores fill
// huge pages (the folio LargeFolio found) is fine whether its mount or the
// kernel asked for them; one without gets a fix naming the mount point,
// and a mount that asks for them in vain is told why.
func TestHugePagesJudgementNamesWhatTheKernelGives(t *testing.T) {
	const pmd = 2 << 20
	for _, c := range []struct {
		name    string
		options string
		folio   int64
		level   string
		want    string
	}{
		{"no huge option", "rw,inode64", 0, levelInfo, "tmpfs with 4 KiB pages (huge=never)"},
		{"huge=advise: writes get small pages", "rw,huge=advise", 0, levelInfo, "tmpfs with 4 KiB pages (huge=advise)"},
		{"huge=within_size", "rw,size=41943040k,huge=within_size", pmd, levelOK, "tmpfs with huge pages (huge=within_size)"},
		{"huge=always", "rw,huge=always", pmd, levelOK, "tmpfs with huge pages (huge=always)"},
		{"forced by the kernel", "rw", pmd, levelOK, "the kernel forces them"},
		{"denied by the kernel", "rw,huge=always", 0, levelInfo, "no huge pages that kvhost's stores fill"},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := fstype.Mount{Point: "/mnt/kv", Type: "tmpfs", Options: c.options}
			level, what, fix := hugePagesJudgement(m, c.folio)
			if level != c.level || !strings.Contains(what, c.want) {
				t.Fatalf("%s %q; want %s containing %q", level, what, c.level, c.want)
			}
			if (level == levelOK) != (fix == "") {
				t.Fatalf("level %s with fix %q", level, fix)
			}
			if strings.Contains(c.want, "4 KiB pages") && !strings.Contains(fix, "remount,huge=within_size /mnt/kv") {
				t.Fatalf("fix %q does not name the mount point", fix)
			}
		})
	}
}

// TestTmpfsFixesKeepTheMountPrivate: every fix of check that mounts a
// tmpfs for kvhost makes its directory first and mounts it mode=0750, as
// docs/serve.md does: without mode= a tmpfs root is 1777, world-writable.
func TestTmpfsFixesKeepTheMountPrivate(t *testing.T) {
	_, _, smallPages := hugePagesJudgement(fstype.Mount{Point: "/mnt/kv", Type: "tmpfs", Options: "rw"}, 0)
	_, _, hugetlbfs := fileSystemFinding("hugetlbfs", fstype.Kind{MapOnly: true}, 0, 0, 0)
	_, _, ramfs := fileSystemFinding("ramfs", fstype.Kind{Memory: true}, 0, 0, 0)
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "serve.md"))
	if err != nil {
		t.Fatal(err)
	}
	for name, fix := range map[string]string{"small pages": smallPages, "hugetlbfs": hugetlbfs, "ramfs": ramfs} {
		_, cmd, ok := strings.Cut(fix, "mkdir -p /mnt/kvcache && mount -t tmpfs -o ")
		if !ok {
			t.Errorf("%s: fix %q makes no directory before mounting a tmpfs", name, fix)
			continue
		}
		opts, _, _ := strings.Cut(cmd, " ")
		if !strings.Contains(opts, "mode=0750") {
			t.Errorf("%s: fix %q mounts a tmpfs without mode=0750", name, fix)
		}
		if !strings.Contains(string(doc), "mount -t tmpfs -o "+opts+" tmpfs /mnt/kvcache") {
			t.Errorf("%s: docs/serve.md mounts the tmpfs otherwise than the fix (-o %s)", name, opts)
		}
	}
}

func TestPreallocateFindingSaysWhatIsMadeAhead(t *testing.T) {
	const gib = 1 << 30
	cases := []struct {
		name      string
		p         config.AutoSize
		keeps     bool
		effective int64
		level     string
		want      string
	}{
		{"auto on tmpfs", config.Auto(), true, 16 * gib, levelOK, "up to 2 GiB, up to 4 GiB after larger bursts of stores (preallocate auto"},
		{"auto on a large tmpfs", config.Auto(), true, 100 * gib, levelOK, autoFinding(100 * gib)},
		{"a size on tmpfs", config.SizeOf(8 * gib), true, 100 * gib, levelOK, "up to 8 GiB, shared"},
		{"turned off", config.SizeOf(0), true, 100 * gib, levelInfo, "no spare files made ahead"},
		{"a size on a disk", config.SizeOf(gib), false, 100 * gib, levelWarn, "has no effect here"},
		{"auto on a disk", config.Auto(), false, 100 * gib, "", ""},
	}
	for _, c := range cases {
		level, what, _ := preallocateFinding(c.p, c.keeps, c.effective)
		if level != c.level || !strings.Contains(what, c.want) {
			t.Errorf("%s: %s %q; want %s containing %q", c.name, level, what, c.level, c.want)
		}
	}
}

func TestCheckKeepsSparesOnTheMemoryFileSystemsTheEngineDoes(t *testing.T) {
	cases := []struct {
		name    string
		magic   int64
		layout  string
		reuse   bool
		cluster config.Size
		want    bool
	}{
		{"tmpfs", fstype.Tmpfs, config.LayoutKVHost, true, 0, true},
		{"ramfs", fstype.Ramfs, config.LayoutKVHost, true, 0, true},
		{"hugetlbfs", fstype.Hugetlbfs, "", true, 0, true},
		{"ext4", fstype.Ext4, config.LayoutKVHost, true, 0, false},
		{"tmpfs in vLLM's layout", fstype.Tmpfs, config.LayoutVLLMFS, true, 0, false},
		{"tmpfs with reuse_files off", fstype.Tmpfs, config.LayoutKVHost, false, 0, false},
		{"tmpfs with a cluster_capacity", fstype.Tmpfs, config.LayoutKVHost, true, 1 << 30, false},
		{"an unknown file system", 0x1234, config.LayoutKVHost, true, 0, false},
	}
	for _, c := range cases {
		m := config.Mount{Layout: c.layout, ClusterCapacity: c.cluster}
		if got := keepsSpares(c.magic, m, c.reuse); got != c.want {
			t.Errorf("%s: keepsSpares = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestCheckLeavesNoCUDAStateOnItsCallersThread: doCheck makes device 0
// current for its CUDA and cuFile calls. That must happen on a thread of
// its own that ends afterwards (cuda/worker.go's rule): done on
// the caller's thread and unlocked on return, the thread goes back to the
// scheduler with CUDA state on it. The caller here is locked to a thread
// with device 1 current, and must find it so after the check.
func TestCheckLeavesNoCUDAStateOnItsCallersThread(t *testing.T) {
	cudaLib, cufileLib := cudatest.Build(t), daemontest.BuildFakeCuFile(t)
	rt, err := cuda.Open(cuda.Config{Runtime: []string{cudaLib}})
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	o := checkOptions{cfg: config.Default(), dirs: []string{t.TempDir()}}
	o.cfg.GPU.CUDALibrary, o.cfg.GPU.CuFileLibrary = cudaLib, cufileLib
	type result struct {
		dev int
		err error
		rep *checkReport
	}
	done := make(chan result, 1)
	go func() {
		// Never unlocked: this thread's device is changed here, so it
		// ends with the goroutine.
		runtime.LockOSThread()
		if err := rt.SetDevice(1); err != nil {
			done <- result{err: err}
			return
		}
		rep := doCheck(context.Background(), o)
		dev, err := rt.Device()
		done <- result{dev, err, rep}
	}()
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.rep.Fail != 0 {
		t.Fatalf("the check failed: %+v", r.rep.Items)
	}
	if r.dev != 1 {
		t.Fatalf("after doCheck the caller's thread has device %d current, had 1", r.dev)
	}
}

// TestABuildWithoutCgoSaysCPUOnlyAndSuggestsNoCUDAInstall plays a build
// without cgo (no gcc): kvhost version says it is CPU only, and kvhost
// check says so too, with a rebuild as the fix instead of installing CUDA
// (which that binary could not load).
func TestABuildWithoutCgoSaysCPUOnlyAndSuggestsNoCUDAInstall(t *testing.T) {
	old := gpuBuild
	gpuBuild = false
	t.Cleanup(func() { gpuBuild = old })
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"version"}, &out, &errb); code != 0 || !strings.Contains(out.String(), "CPU only") {
		t.Fatalf("version: exit %d, %q: want CPU only", code, out.String())
	}
	out.Reset()
	run(context.Background(), []string{"check", "--dir", t.TempDir(), "--json"}, &out, &errb)
	var rep checkReport
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("check --json: %v\n%s", err, errb.String())
	}
	cpuOnly := false
	for _, it := range rep.Items {
		if strings.Contains(it.Fix, "CUDA runtime") || strings.Contains(it.Fix, "install libcufile") {
			t.Errorf("check suggests installing CUDA to a binary that cannot load it: %+v", it)
		}
		cpuOnly = cpuOnly || it.Area == "gpu" && strings.Contains(it.What, "CPU only")
	}
	if !cpuOnly {
		t.Errorf("check does not say the build is CPU only: %+v", rep.Items)
	}
}

// autoFinding is how the preallocate finding of auto on a tmpfs of
// effective bytes begins on this machine (its memory sets the bounds).
func autoFinding(effective int64) string {
	mem := engine.MachineMemory()
	b, g := engine.AutoPreallocate(effective, mem), engine.AutoPreallocateMax(effective, mem)
	if g > b {
		return "up to " + sizeOf(b) + ", up to " + sizeOf(g) + " after larger bursts of stores (preallocate auto"
	}
	return "up to " + sizeOf(b) + " (preallocate auto"
}

// TestCheckSaysWhatTheEngineMakesOfRamfsAndHugetlbfs: on hugetlbfs, whose
// files write(2) refuses, the engine refuses the mount: check FAILs,
// pointing to a tmpfs with huge=within_size. On ramfs, which reports no
// size, the engine needs a configured capacity: check FAILs without one
// and says the capacity is the capacity with one. Neither is called full
// (statfs says 0 bytes free there, which means nothing), and the human
// and the JSON output say the same.
func TestCheckSaysWhatTheEngineMakesOfRamfsAndHugetlbfs(t *testing.T) {
	const mib = 1 << 20
	for _, c := range []struct {
		name     string
		magic    int64
		capacity int64
		level    string
		what     []string
		fix      string
	}{
		{"hugetlbfs", fstype.Hugetlbfs, 0, levelFail, []string{"hugetlbfs", "the engine refuses"}, "huge=within_size"},
		{"hugetlbfs with a capacity", fstype.Hugetlbfs, 64 * mib, levelFail, []string{"hugetlbfs", "the engine refuses"}, "huge=within_size"},
		{"ramfs", fstype.Ramfs, 0, levelFail, []string{"ramfs reports no size", "needs a configured capacity"}, "capacity"},
		{"ramfs with a capacity", fstype.Ramfs, 64 * mib, levelInfo, []string{"ramfs reports no size", "the configured capacity, 64 MiB, is the capacity"}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			o := checkOptions{cfg: config.Default(), statfs: func(path string, st *unix.Statfs_t) error {
				if err := unix.Statfs(path, st); err != nil {
					return err
				}
				// What ramfs and a hugetlbfs without size= say.
				st.Type, st.Blocks, st.Bfree, st.Bavail = c.magic, 0, 0, 0
				return nil
			}}
			o.cfg.GPU.Mode, o.cfg.GPU.CuFile = "off", "off"
			o.cfg.Mounts = []config.Mount{{Path: dir, Capacity: config.Size(c.capacity)}}
			rep := doCheck(context.Background(), o)
			var found *checkItem
			for i, it := range rep.Items {
				if strings.Contains(it.What, "full for kvhost") {
					t.Errorf("called full: %s %s", it.Level, it.What)
				}
				says := it.Area == dir
				for _, w := range c.what {
					says = says && strings.Contains(it.What, w)
				}
				if says && found == nil {
					found = &rep.Items[i]
				}
			}
			if found == nil {
				t.Fatalf("no finding on %s saying %q: %+v", dir, c.what, rep.Items)
			}
			if found.Level != c.level || !strings.Contains(found.Fix, c.fix) || (c.fix == "") != (found.Fix == "") {
				t.Errorf("finding %s %q, fix %q: want %s with a fix saying %q", found.Level, found.What, found.Fix, c.level, c.fix)
			}
			if wantFail := c.level == levelFail; (rep.Fail > 0) != wantFail {
				t.Errorf("%d failures: want some %v", rep.Fail, wantFail)
			}
			var human bytes.Buffer
			writeCheck(&human, rep)
			if line := fmt.Sprintf("%-4s  %-8s  %s\n", found.Level, found.Area, found.What); !strings.Contains(human.String(), line) {
				t.Errorf("the human output lacks %q:\n%s", line, human.String())
			}
			js, err := json.Marshal(rep)
			if err != nil {
				t.Fatal(err)
			}
			var back checkReport
			if err := json.Unmarshal(js, &back); err != nil {
				t.Fatal(err)
			}
			if !slices.Contains(back.Items, *found) {
				t.Errorf("the JSON output lacks %+v:\n%s", *found, js)
			}
		})
	}
}

// TestCheckTellsAReadOnlyFileSystemFromPermissions: a directory the
// daemon's user may not write FAILs with a fix about its owner, and one
// on a file system mounted read-only FAILs saying so, with a fix that
// remounts it (no chown makes it writable).
func TestCheckTellsAReadOnlyFileSystemFromPermissions(t *testing.T) {
	for _, c := range []struct {
		name      string
		err       error
		what, fix string
	}{
		{"permissions", unix.EACCES, "not writable by this user", "chown"},
		{"read-only file system", unix.EROFS, "on a read-only file system", "remount it read-write"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			o := checkOptions{cfg: config.Default(), access: func(path string, mode uint32) error {
				if path == dir {
					return c.err
				}
				return unix.Access(path, mode)
			}}
			o.cfg.GPU.Mode, o.cfg.GPU.CuFile = "off", "off"
			o.cfg.Mounts = []config.Mount{{Path: dir}}
			rep := doCheck(context.Background(), o)
			var found []checkItem
			for _, it := range rep.Items {
				if it.Area == dir && it.Level == levelFail {
					found = append(found, it)
				}
			}
			if len(found) != 1 || !strings.Contains(found[0].What, c.what) || !strings.Contains(found[0].Fix, c.fix) {
				t.Fatalf("failures on %s: %+v; want one saying %q with a fix saying %q", dir, found, c.what, c.fix)
			}
		})
	}
}

// TestCheckFailsMountsThatOverlap: two mounts of kvhost's layout on one
// directory (through a symbolic link) or one inside the other, made or
// not yet (the daemon makes them), which the daemon refuses at start,
// FAIL; two directories side by side, and a
// vllm-fs mount inside a kvhost one (the engine allows it), do not.
func TestCheckFailsMountsThatOverlap(t *testing.T) {
	dir := t.TempDir()
	a, b, inner, link := filepath.Join(dir, "a"), filepath.Join(dir, "b"), filepath.Join(dir, "a", "inner"), filepath.Join(dir, "link")
	for _, d := range []string{a, b, inner} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(a, link); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		mounts []config.Mount
		fail   bool
	}{
		{"side by side", []config.Mount{{Path: a}, {Path: b}}, false},
		{"one inside the other", []config.Mount{{Path: a}, {Path: inner}}, true},
		{"one directory through a link", []config.Mount{{Path: a}, {Path: link}}, true},
		{"one inside the other, not made yet", []config.Mount{{Path: filepath.Join(dir, "new")}, {Path: filepath.Join(dir, "new", "inner")}}, true},
		{"a vllm-fs mount inside", []config.Mount{{Path: a}, {Path: inner, Layout: config.LayoutVLLMFS}}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			o := checkOptions{cfg: config.Default()}
			o.cfg.GPU.Mode, o.cfg.GPU.CuFile = "off", "off"
			o.cfg.Mounts = c.mounts
			rep := doCheck(context.Background(), o)
			var found []checkItem
			for _, it := range rep.Items {
				if strings.Contains(it.What, "overlap") {
					found = append(found, it)
				}
			}
			if c.fail && (len(found) != 1 || found[0].Level != levelFail || rep.Fail == 0) {
				t.Fatalf("findings on overlap %+v (%d failures); want one FAIL", found, rep.Fail)
			}
			if !c.fail && len(found) != 0 {
				t.Fatalf("findings on overlap %+v; want none", found)
			}
		})
	}
}

// TestCheckFailsASocketGroupTheMachineLacks: `kvhost check --config` FAILs
// a server.socket_group this machine has no group of (the daemon would
// not start), and passes one it has, or a numeric id.
func TestCheckFailsASocketGroupTheMachineLacks(t *testing.T) {
	for _, c := range []struct {
		group string
		level string
	}{
		{"kvhost-no-such-group", levelFail},
		{"root", levelOK},
		{"2000", levelOK},
	} {
		t.Run(c.group, func(t *testing.T) {
			o := checkOptions{cfg: config.Default()}
			o.cfg.GPU.Mode, o.cfg.GPU.CuFile = "off", "off"
			o.cfg.Mounts = []config.Mount{{Path: t.TempDir()}}
			o.cfg.Server.SocketGroup = c.group
			rep := doCheck(context.Background(), o)
			var found []checkItem
			for _, it := range rep.Items {
				if strings.Contains(it.What, "socket_group") {
					found = append(found, it)
				}
			}
			if len(found) != 1 || found[0].Level != c.level || !strings.Contains(found[0].What, c.group) {
				t.Fatalf("findings on the socket group: %+v; want one %s naming %q", found, c.level, c.group)
			}
			if c.level == levelFail && (rep.Fail == 0 || found[0].Fix == "") {
				t.Fatalf("%d failures, fix %q; want a failure with a fix", rep.Fail, found[0].Fix)
			}
		})
	}
}

// TestCheckFailsAVLLMFSMountTheDaemonCannotAdopt: a vllm-fs mount without
// the fs tier's fields FAILs where the daemon's start finds no base
// directory to adopt under its root (vLLM has not written it: the root
// empty or not made), several, or one whose config.json does not hash to
// its name; one written by the tier is adopted (OK), and with the fields
// configured nothing is asked of the root.
func TestCheckFailsAVLLMFSMountTheDaemonCannotAdopt(t *testing.T) {
	fields := func(model string) vllmfs.Fields {
		return vllmfs.Fields{ModelName: model, TokensPerHash: 16, BlocksPerFile: 1, TPSize: 1, PPSize: 1, PCPSize: 1, DCPSize: 1,
			Dtype: "bfloat16", KVCacheGroups: []vllmfs.Group{{TokensPerBlock: 16, LayerNames: []string{"l0"}}}, NotParallelAgnostic: true}
	}
	// write makes the base directory vLLM's fs tier writes for model
	// under root, named as given ("": its hash's name).
	write := func(t *testing.T, root, model, name string) {
		t.Helper()
		c, err := vllmfs.FromFields(fields(model))
		if err != nil {
			t.Fatal(err)
		}
		if name == "" {
			name = c.Base()
		}
		if err := os.MkdirAll(filepath.Join(root, name), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, name, vllmfs.ConfigFile), c.JSON(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		name   string
		make   func(t *testing.T, root string)
		fields bool
		level  string // of the vllm-fs finding; "": none
		want   string
	}{
		{"a root vLLM has not made", nil, false, levelFail, "no base directory with a config.json to adopt"},
		{"an empty root", func(t *testing.T, root string) { os.MkdirAll(root, 0o755) }, false, levelFail, "no base directory with a config.json to adopt"},
		{"the tier's directory", func(t *testing.T, root string) { write(t, root, "m/a", "") }, false, levelOK, "adopts the base directory"},
		{"two models' directories", func(t *testing.T, root string) { write(t, root, "m/a", ""); write(t, root, "m/b", "") }, false, levelFail, "2 base directories to adopt"},
		{"a directory renamed", func(t *testing.T, root string) { write(t, root, "m/a", "renamed") }, false, levelFail, "not to the directory's name"},
		{"the fields configured", nil, true, "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "vllm-kv")
			if c.make != nil {
				c.make(t, root)
			}
			m := config.Mount{Path: root, Layout: config.LayoutVLLMFS}
			if c.fields {
				f := fields("m/a")
				m.VLLMFS = &config.VLLMFS{ModelName: f.ModelName, TokensPerHash: f.TokensPerHash, BlocksPerFile: f.BlocksPerFile, TPSize: 1, PPSize: 1, PCPSize: 1, DCPSize: 1,
					Dtype: f.Dtype, KVCacheGroups: []config.VLLMFSGroup{{TokensPerBlock: 16, LayerNames: []string{"l0"}}}}
			}
			var rep checkReport
			checkVLLMAdoption(&rep, m)
			if c.level == "" {
				if len(rep.Items) != 0 {
					t.Fatalf("findings %+v; want none", rep.Items)
				}
				return
			}
			if len(rep.Items) != 1 || rep.Items[0].Level != c.level || !strings.Contains(rep.Items[0].What, c.want) || (c.level == levelFail) != (rep.Fail == 1) {
				t.Fatalf("findings %+v; want one %s saying %q", rep.Items, c.level, c.want)
			}
		})
	}
}

// TestCheckFailsAMissingMountItsParentRefuses: a mount's directory that
// does not exist is made by the daemon at start, which fails where the
// directory above it is on a read-only file system or not writable by
// the daemon's user; check FAILs then, naming the directory it cannot be
// made in, instead of warning that the daemon makes it. Where it may be
// made, the warning stays.
func TestCheckFailsAMissingMountItsParentRefuses(t *testing.T) {
	for _, c := range []struct {
		name      string
		err       error
		level     string
		what, fix string
	}{
		{"permissions", unix.EACCES, levelFail, "cannot be made in", "chown"},
		{"read-only file system", unix.EROFS, levelFail, "read-only file system", "remount it read-write"},
		{"writable", nil, levelWarn, "kvhost creates it at start", "mkdir -p"},
	} {
		t.Run(c.name, func(t *testing.T) {
			parent := t.TempDir()
			dir := filepath.Join(parent, "a", "blocks")
			o := checkOptions{cfg: config.Default(), access: func(path string, mode uint32) error {
				if path == parent && c.err != nil {
					return c.err
				}
				return unix.Access(path, mode)
			}}
			o.cfg.GPU.Mode, o.cfg.GPU.CuFile = "off", "off"
			o.cfg.Mounts = []config.Mount{{Path: dir}}
			rep := doCheck(context.Background(), o)
			var found []checkItem
			for _, it := range rep.Items {
				if it.Area == dir && (it.Level == levelFail || it.Level == levelWarn) {
					found = append(found, it)
				}
			}
			if len(found) != 1 || found[0].Level != c.level || !strings.Contains(found[0].What, c.what) || !strings.Contains(found[0].Fix, c.fix) {
				t.Fatalf("findings on %s: %+v; want one %s saying %q with a fix saying %q", dir, found, c.level, c.what, c.fix)
			}
			if c.err != nil && !strings.Contains(found[0].What, parent) {
				t.Errorf("%q: want it to name %s, where the daemon would make the directory", found[0].What, parent)
			}
		})
	}
}

// TestCheckSpeedNeverWritesThroughALinkInTheMount: `kvhost check --speed`
// writes a file in each mount's directory, which others may write too
// (a shared mount, /dev/shm). A symbolic link planted at the speed
// file's name, before the test makes the file (its name was the pid's)
// or between its passes (each opens the file anew by name), must not
// make the check (often run as root) truncate and overwrite the file the
// link points to: the check makes its file under a fresh name, and every
// pass refuses a link at the name.
func TestCheckSpeedNeverWritesThroughALinkInTheMount(t *testing.T) {
	const theirs = "not kvhost's"
	victim := func(t *testing.T) string {
		t.Helper()
		p := filepath.Join(t.TempDir(), "victim")
		if err := os.WriteFile(p, []byte(theirs), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	untouched := func(t *testing.T, p string) {
		t.Helper()
		if b, err := os.ReadFile(p); err != nil || string(b) != theirs {
			t.Errorf("the file the link points to was written through it: %d bytes, not %q (%v)", len(b), theirs, err)
		}
	}
	t.Run("planted before the check", func(t *testing.T) {
		dir, v := t.TempDir(), victim(t)
		link := filepath.Join(dir, fmt.Sprintf(".kvhost-check-speed-%d", os.Getpid()))
		if err := os.Symlink(v, link); err != nil {
			t.Fatal(err)
		}
		missing := filepath.Join(dir, "nothing.so")
		if code, out := runCheckCmd(t, "--dir", dir, "--cuda-library", missing, "--cufile-library", missing, "--speed", "--speed-size", "2MiB"); code != 0 {
			t.Fatalf("exit %d:\n%s", code, out)
		}
		untouched(t, v)
		if _, err := os.Lstat(link); err != nil {
			t.Errorf("the link, someone's, was removed: %v", err)
		}
	})
	t.Run("planted between passes", func(t *testing.T) {
		dir, v := t.TempDir(), victim(t)
		name := filepath.Join(dir, ".kvhost-check-speed-x")
		if err := os.Symlink(v, name); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 4096)
		for _, write := range []bool{true, false} {
			if _, _, err := speedPass(context.Background(), name, buf, 4096, time.Second, false, write); !errors.Is(err, unix.ELOOP) {
				t.Errorf("a pass (write %v) on a link: %v, want ELOOP", write, err)
			}
		}
		untouched(t, v)
	})
}

// TestCheckSummaryCountsInTheSingularForOne: the last line of `kvhost
// check` says "1 warning" and "1 failure", and the plural for any other
// count.
func TestCheckSummaryCountsInTheSingularForOne(t *testing.T) {
	for _, tc := range []struct {
		warn, fail int
		want       string
	}{
		{0, 0, "kvhost check: 2 ok, 0 warnings, 0 failures\n"},
		{1, 1, "kvhost check: 2 ok, 1 warning, 1 failure\n"},
		{2, 3, "kvhost check: 2 ok, 2 warnings, 3 failures\n"},
	} {
		var b strings.Builder
		writeCheck(&b, &checkReport{OK: 2, Warn: tc.warn, Fail: tc.fail})
		if b.String() != tc.want {
			t.Errorf("warnings %d, failures %d: %q, want %q", tc.warn, tc.fail, b.String(), tc.want)
		}
	}
}

// TestCheckFailsAMountOnAKernelInterface: a mount on proc or sysfs,
// made there or not, was judged as any directory: one to be made in
// /proc or /sys got "does not exist; kvhost creates it at start" (the
// start then failed at its mkdir), and /proc itself was named by its
// magic number, 0x9fa0. Check FAILs both, naming the file system, as
// the engine refuses such a mount.
func TestCheckFailsAMountOnAKernelInterface(t *testing.T) {
	for _, c := range []struct {
		name   string
		exists bool
	}{
		{"the directory exists", true},
		{"the directory is to be made", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			parent := t.TempDir()
			dir := filepath.Join(parent, "kvhost")
			if c.exists {
				if err := os.Mkdir(dir, 0o750); err != nil {
					t.Fatal(err)
				}
			}
			o := checkOptions{cfg: config.Default(), statfs: func(path string, st *unix.Statfs_t) error {
				if err := unix.Statfs(path, st); err != nil {
					return err
				}
				st.Type, st.Blocks, st.Bfree, st.Bavail = 0x9fa0, 0, 0, 0
				return nil
			}}
			o.cfg.GPU.Mode, o.cfg.GPU.CuFile = "off", "off"
			o.cfg.Mounts = []config.Mount{{Path: dir, Capacity: 1 << 30}}
			rep := doCheck(context.Background(), o)
			var fails []checkItem
			for _, it := range rep.Items {
				if it.Area == dir && it.Level == levelFail {
					fails = append(fails, it)
				}
			}
			if len(fails) != 1 || !strings.Contains(fails[0].What, "proc") || !strings.Contains(fails[0].What, "kernel interface") || !strings.Contains(fails[0].Fix, "tmpfs") {
				t.Fatalf("findings %+v; want one FAIL on %s naming proc, a kernel interface, with a fix naming a tmpfs", rep.Items, dir)
			}
		})
	}
}

// TestCheckFailsAnObjectMountItCannotReach: an [objects] endpoint that
// refuses connections is a FAIL naming the bucket and the endpoint, as
// the daemon would not start.
func TestCheckFailsAnObjectMountItCannotReach(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("KVHOST_S3_ACCESS_KEY", "test-access")
	t.Setenv("KVHOST_S3_SECRET_KEY", "test-secret")
	cfg := filepath.Join(dir, "kvhost.toml")
	body := "[[mount]]\npath = \"" + dir + "\"\n\n[objects]\nendpoint = \"http://127.0.0.1:1\"\nbucket = \"kv\"\nrequest_timeout = \"2s\"\n"
	if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out := runCheckCmd(t, "--config", cfg)
	if code != 1 || !strings.Contains(out, "FAIL  objects") || !strings.Contains(out, "bucket kv at http://127.0.0.1:1") {
		t.Fatalf("exit %d; want 1 with a FAIL line naming the bucket and the endpoint:\n%s", code, out)
	}
}
