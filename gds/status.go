package gds

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/kvhost/kvhost/cuda"
)

// Status is a cuFile status code (CUfileOpError). A failed cuFile call
// returns an error wrapping its Status, so callers test for a code with
// errors.Is(err, gds.StatusHandleNotRegistered). A Status prints its name,
// number and meaning without the library:
//
//	cufile: CU_FILE_HANDLE_NOT_REGISTERED (5027): file handle not registered
type Status int

// cuFile status codes, numbered as cufile.h numbers them (5000 + n). The
// package exports the codes its importers test for; Error and Name print
// every code, and errors.As finds the Status of any.
const (
	statusSuccess                   Status = 0
	statusDriverNotInitialized      Status = 5001
	statusDriverInvalidProps        Status = 5002
	statusDriverUnsupportedLimit    Status = 5003
	statusDriverVersionMismatch     Status = 5004
	statusDriverVersionReadError    Status = 5005
	statusDriverClosing             Status = 5006
	statusPlatformNotSupported      Status = 5007
	statusIONotSupported            Status = 5008
	statusDeviceNotSupported        Status = 5009
	statusNVFSDriverError           Status = 5010
	statusCUDADriverError           Status = 5011
	statusCUDAPointerInvalid        Status = 5012
	statusCUDAMemoryTypeInvalid     Status = 5013
	statusCUDAPointerRangeError     Status = 5014
	statusCUDAContextMismatch       Status = 5015
	statusInvalidMappingSize        Status = 5016
	statusInvalidMappingRange       Status = 5017
	statusInvalidFileType           Status = 5018
	statusInvalidFileOpenFlag       Status = 5019
	statusDIONotSet                 Status = 5020
	statusInvalidValue              Status = 5022
	statusMemoryAlreadyRegistered   Status = 5023
	statusMemoryNotRegistered       Status = 5024
	statusPermissionDenied          Status = 5025
	statusDriverAlreadyOpen         Status = 5026
	StatusHandleNotRegistered       Status = 5027
	statusHandleAlreadyRegistered   Status = 5028
	statusDeviceNotFound            Status = 5029
	statusInternalError             Status = 5030
	statusGetNewFDFailed            Status = 5031
	statusNVFSSetupError            Status = 5033
	statusIODisabled                Status = 5034
	statusBatchSubmitFailed         Status = 5035
	statusGPUMemoryPinningFailed    Status = 5036
	statusBatchFull                 Status = 5037
	statusAsyncNotSupported         Status = 5038
	statusInternalBatchSetupError   Status = 5039
	statusInternalBatchSubmitError  Status = 5040
	statusInternalBatchGetStatusErr Status = 5041
	statusInternalBatchCancelError  Status = 5042
	statusNoMemory                  Status = 5043
	statusIOError                   Status = 5044
	statusInternalBufRegisterError  Status = 5045
	statusHashOperationError        Status = 5046
	statusInvalidContextError       Status = 5047
	statusNVFSInternalDriverError   Status = 5048
	statusBatchNoCompatError        Status = 5049
	statusIOMaxError                Status = 5050
)

var statusText = map[Status][2]string{
	statusSuccess:                   {"CU_FILE_SUCCESS", "success"},
	statusDriverNotInitialized:      {"CU_FILE_DRIVER_NOT_INITIALIZED", "nvidia-fs driver is not loaded"},
	statusDriverInvalidProps:        {"CU_FILE_DRIVER_INVALID_PROPS", "invalid property"},
	statusDriverUnsupportedLimit:    {"CU_FILE_DRIVER_UNSUPPORTED_LIMIT", "property range error"},
	statusDriverVersionMismatch:     {"CU_FILE_DRIVER_VERSION_MISMATCH", "nvidia-fs driver version mismatch"},
	statusDriverVersionReadError:    {"CU_FILE_DRIVER_VERSION_READ_ERROR", "nvidia-fs driver version read error"},
	statusDriverClosing:             {"CU_FILE_DRIVER_CLOSING", "driver shutdown in progress"},
	statusPlatformNotSupported:      {"CU_FILE_PLATFORM_NOT_SUPPORTED", "GPUDirect Storage not supported on this platform"},
	statusIONotSupported:            {"CU_FILE_IO_NOT_SUPPORTED", "GPUDirect Storage not supported on this file"},
	statusDeviceNotSupported:        {"CU_FILE_DEVICE_NOT_SUPPORTED", "GPUDirect Storage not supported on this GPU"},
	statusNVFSDriverError:           {"CU_FILE_NVFS_DRIVER_ERROR", "nvidia-fs driver ioctl error"},
	statusCUDADriverError:           {"CU_FILE_CUDA_DRIVER_ERROR", "CUDA driver API error"},
	statusCUDAPointerInvalid:        {"CU_FILE_CUDA_POINTER_INVALID", "invalid device pointer"},
	statusCUDAMemoryTypeInvalid:     {"CU_FILE_CUDA_MEMORY_TYPE_INVALID", "invalid pointer memory type"},
	statusCUDAPointerRangeError:     {"CU_FILE_CUDA_POINTER_RANGE_ERROR", "pointer range exceeds allocated address range"},
	statusCUDAContextMismatch:       {"CU_FILE_CUDA_CONTEXT_MISMATCH", "CUDA context mismatch"},
	statusInvalidMappingSize:        {"CU_FILE_INVALID_MAPPING_SIZE", "access beyond maximum pinned size"},
	statusInvalidMappingRange:       {"CU_FILE_INVALID_MAPPING_RANGE", "access beyond mapped size"},
	statusInvalidFileType:           {"CU_FILE_INVALID_FILE_TYPE", "unsupported file type"},
	statusInvalidFileOpenFlag:       {"CU_FILE_INVALID_FILE_OPEN_FLAG", "unsupported file open flags"},
	statusDIONotSet:                 {"CU_FILE_DIO_NOT_SET", "file not opened with O_DIRECT"},
	statusInvalidValue:              {"CU_FILE_INVALID_VALUE", "invalid API argument"},
	statusMemoryAlreadyRegistered:   {"CU_FILE_MEMORY_ALREADY_REGISTERED", "device pointer already registered"},
	statusMemoryNotRegistered:       {"CU_FILE_MEMORY_NOT_REGISTERED", "device pointer lookup failure"},
	statusPermissionDenied:          {"CU_FILE_PERMISSION_DENIED", "driver or file access error"},
	statusDriverAlreadyOpen:         {"CU_FILE_DRIVER_ALREADY_OPEN", "driver is already open"},
	StatusHandleNotRegistered:       {"CU_FILE_HANDLE_NOT_REGISTERED", "file handle not registered"},
	statusHandleAlreadyRegistered:   {"CU_FILE_HANDLE_ALREADY_REGISTERED", "file handle already registered"},
	statusDeviceNotFound:            {"CU_FILE_DEVICE_NOT_FOUND", "GPU device not found"},
	statusInternalError:             {"CU_FILE_INTERNAL_ERROR", "internal error"},
	statusGetNewFDFailed:            {"CU_FILE_GETNEWFD_FAILED", "failed to obtain a new file descriptor"},
	statusNVFSSetupError:            {"CU_FILE_NVFS_SETUP_ERROR", "nvidia-fs driver initialization error"},
	statusIODisabled:                {"CU_FILE_IO_DISABLED", "GPUDirect Storage disabled by config on this file"},
	statusBatchSubmitFailed:         {"CU_FILE_BATCH_SUBMIT_FAILED", "failed to submit batch operation"},
	statusGPUMemoryPinningFailed:    {"CU_FILE_GPU_MEMORY_PINNING_FAILED", "failed to allocate pinned GPU memory"},
	statusBatchFull:                 {"CU_FILE_BATCH_FULL", "queue full for batch operation"},
	statusAsyncNotSupported:         {"CU_FILE_ASYNC_NOT_SUPPORTED", "asynchronous I/O not supported"},
	statusInternalBatchSetupError:   {"CU_FILE_INTERNAL_BATCH_SETUP_ERROR", "internal batch setup error"},
	statusInternalBatchSubmitError:  {"CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR", "internal batch submit error"},
	statusInternalBatchGetStatusErr: {"CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR", "internal batch status error"},
	statusInternalBatchCancelError:  {"CU_FILE_INTERNAL_BATCH_CANCEL_ERROR", "internal batch cancel error"},
	statusNoMemory:                  {"CU_FILE_NOMEM_ERROR", "out of memory"},
	statusIOError:                   {"CU_FILE_IO_ERROR", "I/O error"},
	statusInternalBufRegisterError:  {"CU_FILE_INTERNAL_BUF_REGISTER_ERROR", "internal buffer registration error"},
	statusHashOperationError:        {"CU_FILE_HASH_OPR_ERROR", "internal hash table error"},
	statusInvalidContextError:       {"CU_FILE_INVALID_CONTEXT_ERROR", "invalid CUDA context"},
	statusNVFSInternalDriverError:   {"CU_FILE_NVFS_INTERNAL_DRIVER_ERROR", "nvidia-fs internal driver error"},
	statusBatchNoCompatError:        {"CU_FILE_BATCH_NOCOMPAT_ERROR", "batch I/O not supported in compatibility mode"},
	statusIOMaxError:                {"CU_FILE_IO_MAX_ERROR", "maximum error code"},
}

// Name is the code's name in cufile.h ("CU_FILE_HANDLE_NOT_REGISTERED"),
// or "CU_FILE_UNKNOWN" for a code this package does not know.
func (s Status) Name() string {
	if t, ok := statusText[s]; ok {
		return t[0]
	}
	return "CU_FILE_UNKNOWN"
}

// Error implements error.
func (s Status) Error() string {
	t, ok := statusText[s]
	if !ok {
		return fmt.Sprintf("cufile: CU_FILE_UNKNOWN (%d): unknown status", int(s))
	}
	return fmt.Sprintf("cufile: %s (%d): %s", t[0], int(s), t[1])
}

// statusError converts a CUfileError_t to an error: nil for success, the
// Status otherwise, with the CUDA driver's result (a cuda.Result, so a
// sticky one matches cuda.ErrSticky) when the code says the CUDA driver
// failed.
func statusError(code, cuErr int) error {
	if code == 0 {
		return nil
	}
	st := Status(code)
	if st == statusCUDADriverError || cuErr != 0 {
		return fmt.Errorf("%w (%w)", st, cuda.Result(cuErr))
	}
	return st
}

// ioError converts a negative return of cuFileRead or cuFileWrite: -1 means
// errno (given) says what failed, an errno or, from 5000 up, a cuFile
// status. cuFile's codes start at 5000; between
// them and -1 the return is a negated errno (compat mode returns what its
// POSIX call failed with, -5 for EIO, as asynchronous I/O does); from
// -5000 down it is -Status.
func ioError(ret int64, errno error) error {
	switch {
	case ret == -1:
		if errno == nil {
			return errors.New("cufile: I/O failed with -1 and no errno")
		}
		// cuFile 1.15 in compatibility mode sets errno to one of its
		// statuses (5019 reading through a write-only descriptor, on the
		// H100 machine).
		if e, ok := errno.(syscall.Errno); ok && e >= 5000 {
			return Status(e)
		}
		return fmt.Errorf("cufile: %w", errno)
	case -ret < 5000:
		return fmt.Errorf("cufile: %w", syscall.Errno(-ret))
	}
	return Status(-ret)
}
