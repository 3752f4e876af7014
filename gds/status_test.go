package gds

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/cuda"
)

func TestStatusPrintsNameNumberAndMeaningWithoutLibrary(t *testing.T) {
	tests := []struct {
		s    Status
		want string
	}{
		{StatusHandleNotRegistered, "cufile: CU_FILE_HANDLE_NOT_REGISTERED (5027): file handle not registered"},
		{statusInternalError, "cufile: CU_FILE_INTERNAL_ERROR (5030): internal error"},
		{statusDriverNotInitialized, "cufile: CU_FILE_DRIVER_NOT_INITIALIZED (5001): nvidia-fs driver is not loaded"},
		{Status(5999), "cufile: CU_FILE_UNKNOWN (5999): unknown status"},
	}
	for _, tt := range tests {
		if got := tt.s.Error(); got != tt.want {
			t.Errorf("Status(%d).Error() = %q, want %q", int(tt.s), got, tt.want)
		}
	}
}

func TestStatusErrorIsMatchableThroughWrapping(t *testing.T) {
	err := fmt.Errorf("register /x: %w", statusError(5027, 0))
	if !errors.Is(err, StatusHandleNotRegistered) {
		t.Fatalf("errors.Is(%v, StatusHandleNotRegistered) = false", err)
	}
	if statusError(0, 0) != nil {
		t.Fatal("status 0 is not success")
	}
	cu := statusError(int(statusCUDADriverError), 700)
	if !errors.Is(cu, statusCUDADriverError) || !strings.Contains(cu.Error(), "CUresult 700") || !errors.Is(cu, cuda.ErrSticky) {
		t.Fatalf("CUDA driver error = %v, want the status and CUresult 700, a sticky one", cu)
	}
	if oom := statusError(int(statusCUDADriverError), 2); errors.Is(oom, cuda.ErrSticky) {
		t.Fatalf("CUDA driver error %v: CUresult 2 (out of memory) taken for a sticky one", oom)
	}
	if io := ioError(-5030, nil); !errors.Is(io, statusInternalError) {
		t.Fatalf("ioError(-5030) = %v", io)
	}
}

func TestIOErrorTellsErrnosFromStatuses(t *testing.T) {
	tests := []struct {
		ret   int64
		errno error
		want  error
	}{
		{-1, syscall.EBADF, syscall.EBADF},
		// cuFile 1.15 in compatibility mode, reading through a write-only
		// descriptor on the H100: -1 with errno set to a cuFile status.
		{-1, syscall.Errno(statusIOError), statusIOError},
		{-int64(syscall.EIO), nil, syscall.EIO},
		{-int64(syscall.ENOSPC), nil, syscall.ENOSPC},
		{-int64(statusIOError), nil, statusIOError},
		{-int64(statusInternalError), nil, statusInternalError},
	}
	for _, tt := range tests {
		if err := ioError(tt.ret, tt.errno); !errors.Is(err, tt.want) {
			t.Errorf("ioError(%d, %v) = %v, want it to match %v", tt.ret, tt.errno, err, tt.want)
		}
	}
}

func TestOpenWithoutLibraryReturnsErrUnavailable(t *testing.T) {
	_, err := Open(Config{LibraryPaths: []string{"/nonexistent/libcufile.so.0"}})
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Open = %v, want ErrUnavailable", err)
	}
}

func TestReadAllowCompatFromCommentedJSON(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name, body         string
		allowed, found, ok bool
	}{
		{"true with comments", "// cufile.json\n{\n \"logging\": {\"dir\": \"/var/log//x\"}, // a comment\n \"properties\": {\n  // \"allow_compat_mode\": false,\n  \"allow_compat_mode\": true\n }\n}\n", true, true, true},
		{"false", `{"properties": {"allow_compat_mode": false}}`, false, true, true},
		{"key absent", `{"properties": {}}`, false, false, true},
		{"not json", `{"properties": `, false, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := filepath.Join(dir, tt.name+".json")
			if err := os.WriteFile(p, []byte(tt.body), 0o600); err != nil {
				t.Fatal(err)
			}
			allowed, found, err := readAllowCompat(p)
			if (err == nil) != tt.ok || allowed != tt.allowed || found != tt.found {
				t.Fatalf("readAllowCompat = %v, %v, %v; want %v, %v, ok=%v", allowed, found, err, tt.allowed, tt.found, tt.ok)
			}
		})
	}
	if _, found, err := readAllowCompat(filepath.Join(dir, "absent.json")); found || err != nil {
		t.Fatalf("absent file: found=%v err=%v, want not found and no error", found, err)
	}
}
