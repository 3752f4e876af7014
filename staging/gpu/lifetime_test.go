package gpu

import (
	"errors"
	"testing"

	"github.com/kvhost/kvhost/cuda/cudatest"
)

// TestMoverCloseLeavesNoCUDACallForAfterTheRuntimeIsUnloaded: Close
// unregisters every registered file, one a job still holds included,
// before it returns, so that its caller (gpuPaths.Close) may unload the
// CUDA runtime; nothing the job or the engine does afterwards (the job
// ending its use of the file, a Forget, a new job, a Prepare) calls
// CUDA: after dlclose that call would jump into unmapped code. The fake
// library counts the unregistrations and the calls made once it is
// marked unloaded.
func TestMoverCloseLeavesNoCUDACallForAfterTheRuntimeIsUnloaded(t *testing.T) {
	for _, tc := range []struct {
		name   string
		before func(m *Mover, kf *keyFile) // with the file held, before Close
		after  func(m *Mover, kf *keyFile) // after Close, before the job ends
	}{
		{"the job ends after Close", func(*Mover, *keyFile) {}, func(*Mover, *keyFile) {}},
		{"the file is forgotten after Close", func(*Mover, *keyFile) {}, func(m *Mover, kf *keyFile) { m.Forget(kf.id.FileID) }},
		{"the file was forgotten before Close", func(m *Mover, kf *keyFile) { m.Forget(kf.id.FileID) }, func(*Mover, *keyFile) {}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, m, _, _, _, kf := registeredFile(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, RegisterFiles: 4})
			unregs := e.fake.Count(cudatest.OpUnregister)
			rf := m.files.acquire(kf.id, 1) // a job between taking the mapping and ending its use
			if rf == nil {
				t.Fatal("the registered file was not handed out")
			}
			tc.before(m, kf)
			if err := m.Close(); err != nil {
				t.Fatal(err)
			}
			if n := e.fake.Count(cudatest.OpUnregister) - unregs; n != 1 {
				t.Errorf("Close returned with %d of 1 registered files unregistered", n)
			}
			e.fake.Unload(true) // as gpuPaths.Close unloads the runtime next
			t.Cleanup(func() { e.fake.Unload(false) })
			tc.after(m, kf)
			m.files.put(rf, true, false)
			if _, err := m.WriteFile(jobContext(t), kf.f, kf.p, nil); !errors.Is(err, errClosed) {
				t.Errorf("WriteFile after Close: %v, want errClosed", err)
			}
			m.Prepare(kf.f)
			if n := e.fake.CallsAfterUnload(); n != 0 {
				t.Errorf("%d CUDA calls after Close returned and the runtime was unloaded", n)
			}
			if st := m.FileStats(); st.Files != 0 || st.Released != st.Registered {
				t.Errorf("after Close and the job's end: %+v; want every registered file released once", st)
			}
		})
	}
}
