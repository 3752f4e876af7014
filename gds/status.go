package gds

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/kvhost/kvhost/internal/cuda"
)

// Status is a cuFile status code (CUfileOpError). A failed cuFile call
// returns an error wrapping its Status, so callers test for a code with
// errors.Is(err, gds.StatusHandleNotRegistered). A Status prints its name,
// number and meaning without the library:
//
//	cufile: CU_FILE_HANDLE_NOT_REGISTERED (5027): file handle not registered
type Status int

// cuFile status codes, numbered as cufile.h numbers them (5000 + n).
const (
	StatusSuccess                   Status = 0
	StatusDriverNotInitialized      Status = 5001
	StatusDriverInvalidProps        Status = 5002
	StatusDriverUnsupportedLimit    Status = 5003
	StatusDriverVersionMismatch     Status = 5004
	StatusDriverVersionReadError    Status = 5005
	StatusDriverClosing             Status = 5006
	StatusPlatformNotSupported      Status = 5007
	StatusIONotSupported            Status = 5008
	StatusDeviceNotSupported        Status = 5009
	StatusNVFSDriverError           Status = 5010
	StatusCUDADriverError           Status = 5011
	StatusCUDAPointerInvalid        Status = 5012
	StatusCUDAMemoryTypeInvalid     Status = 5013
	StatusCUDAPointerRangeError     Status = 5014
	StatusCUDAContextMismatch       Status = 5015
	StatusInvalidMappingSize        Status = 5016
	StatusInvalidMappingRange       Status = 5017
	StatusInvalidFileType           Status = 5018
	StatusInvalidFileOpenFlag       Status = 5019
	StatusDIONotSet                 Status = 5020
	StatusInvalidValue              Status = 5022
	StatusMemoryAlreadyRegistered   Status = 5023
	StatusMemoryNotRegistered       Status = 5024
	StatusPermissionDenied          Status = 5025
	StatusDriverAlreadyOpen         Status = 5026
	StatusHandleNotRegistered       Status = 5027
	StatusHandleAlreadyRegistered   Status = 5028
	StatusDeviceNotFound            Status = 5029
	StatusInternalError             Status = 5030
	StatusGetNewFDFailed            Status = 5031
	StatusNVFSSetupError            Status = 5033
	StatusIODisabled                Status = 5034
	StatusBatchSubmitFailed         Status = 5035
	StatusGPUMemoryPinningFailed    Status = 5036
	StatusBatchFull                 Status = 5037
	StatusAsyncNotSupported         Status = 5038
	StatusInternalBatchSetupError   Status = 5039
	StatusInternalBatchSubmitError  Status = 5040
	StatusInternalBatchGetStatusErr Status = 5041
	StatusInternalBatchCancelError  Status = 5042
	StatusNoMemory                  Status = 5043
	StatusIOError                   Status = 5044
	StatusInternalBufRegisterError  Status = 5045
	StatusHashOperationError        Status = 5046
	StatusInvalidContextError       Status = 5047
	StatusNVFSInternalDriverError   Status = 5048
	StatusBatchNoCompatError        Status = 5049
	StatusIOMaxError                Status = 5050
)

var statusText = map[Status][2]string{
	StatusSuccess:                   {"CU_FILE_SUCCESS", "success"},
	StatusDriverNotInitialized:      {"CU_FILE_DRIVER_NOT_INITIALIZED", "nvidia-fs driver is not loaded"},
	StatusDriverInvalidProps:        {"CU_FILE_DRIVER_INVALID_PROPS", "invalid property"},
	StatusDriverUnsupportedLimit:    {"CU_FILE_DRIVER_UNSUPPORTED_LIMIT", "property range error"},
	StatusDriverVersionMismatch:     {"CU_FILE_DRIVER_VERSION_MISMATCH", "nvidia-fs driver version mismatch"},
	StatusDriverVersionReadError:    {"CU_FILE_DRIVER_VERSION_READ_ERROR", "nvidia-fs driver version read error"},
	StatusDriverClosing:             {"CU_FILE_DRIVER_CLOSING", "driver shutdown in progress"},
	StatusPlatformNotSupported:      {"CU_FILE_PLATFORM_NOT_SUPPORTED", "GPUDirect Storage not supported on this platform"},
	StatusIONotSupported:            {"CU_FILE_IO_NOT_SUPPORTED", "GPUDirect Storage not supported on this file"},
	StatusDeviceNotSupported:        {"CU_FILE_DEVICE_NOT_SUPPORTED", "GPUDirect Storage not supported on this GPU"},
	StatusNVFSDriverError:           {"CU_FILE_NVFS_DRIVER_ERROR", "nvidia-fs driver ioctl error"},
	StatusCUDADriverError:           {"CU_FILE_CUDA_DRIVER_ERROR", "CUDA driver API error"},
	StatusCUDAPointerInvalid:        {"CU_FILE_CUDA_POINTER_INVALID", "invalid device pointer"},
	StatusCUDAMemoryTypeInvalid:     {"CU_FILE_CUDA_MEMORY_TYPE_INVALID", "invalid pointer memory type"},
	StatusCUDAPointerRangeError:     {"CU_FILE_CUDA_POINTER_RANGE_ERROR", "pointer range exceeds allocated address range"},
	StatusCUDAContextMismatch:       {"CU_FILE_CUDA_CONTEXT_MISMATCH", "CUDA context mismatch"},
	StatusInvalidMappingSize:        {"CU_FILE_INVALID_MAPPING_SIZE", "access beyond maximum pinned size"},
	StatusInvalidMappingRange:       {"CU_FILE_INVALID_MAPPING_RANGE", "access beyond mapped size"},
	StatusInvalidFileType:           {"CU_FILE_INVALID_FILE_TYPE", "unsupported file type"},
	StatusInvalidFileOpenFlag:       {"CU_FILE_INVALID_FILE_OPEN_FLAG", "unsupported file open flags"},
	StatusDIONotSet:                 {"CU_FILE_DIO_NOT_SET", "file not opened with O_DIRECT"},
	StatusInvalidValue:              {"CU_FILE_INVALID_VALUE", "invalid API argument"},
	StatusMemoryAlreadyRegistered:   {"CU_FILE_MEMORY_ALREADY_REGISTERED", "device pointer already registered"},
	StatusMemoryNotRegistered:       {"CU_FILE_MEMORY_NOT_REGISTERED", "device pointer lookup failure"},
	StatusPermissionDenied:          {"CU_FILE_PERMISSION_DENIED", "driver or file access error"},
	StatusDriverAlreadyOpen:         {"CU_FILE_DRIVER_ALREADY_OPEN", "driver is already open"},
	StatusHandleNotRegistered:       {"CU_FILE_HANDLE_NOT_REGISTERED", "file handle not registered"},
	StatusHandleAlreadyRegistered:   {"CU_FILE_HANDLE_ALREADY_REGISTERED", "file handle already registered"},
	StatusDeviceNotFound:            {"CU_FILE_DEVICE_NOT_FOUND", "GPU device not found"},
	StatusInternalError:             {"CU_FILE_INTERNAL_ERROR", "internal error"},
	StatusGetNewFDFailed:            {"CU_FILE_GETNEWFD_FAILED", "failed to obtain a new file descriptor"},
	StatusNVFSSetupError:            {"CU_FILE_NVFS_SETUP_ERROR", "nvidia-fs driver initialization error"},
	StatusIODisabled:                {"CU_FILE_IO_DISABLED", "GPUDirect Storage disabled by config on this file"},
	StatusBatchSubmitFailed:         {"CU_FILE_BATCH_SUBMIT_FAILED", "failed to submit batch operation"},
	StatusGPUMemoryPinningFailed:    {"CU_FILE_GPU_MEMORY_PINNING_FAILED", "failed to allocate pinned GPU memory"},
	StatusBatchFull:                 {"CU_FILE_BATCH_FULL", "queue full for batch operation"},
	StatusAsyncNotSupported:         {"CU_FILE_ASYNC_NOT_SUPPORTED", "asynchronous I/O not supported"},
	StatusInternalBatchSetupError:   {"CU_FILE_INTERNAL_BATCH_SETUP_ERROR", "internal batch setup error"},
	StatusInternalBatchSubmitError:  {"CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR", "internal batch submit error"},
	StatusInternalBatchGetStatusErr: {"CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR", "internal batch status error"},
	StatusInternalBatchCancelError:  {"CU_FILE_INTERNAL_BATCH_CANCEL_ERROR", "internal batch cancel error"},
	StatusNoMemory:                  {"CU_FILE_NOMEM_ERROR", "out of memory"},
	StatusIOError:                   {"CU_FILE_IO_ERROR", "I/O error"},
	StatusInternalBufRegisterError:  {"CU_FILE_INTERNAL_BUF_REGISTER_ERROR", "internal buffer registration error"},
	StatusHashOperationError:        {"CU_FILE_HASH_OPR_ERROR", "internal hash table error"},
	StatusInvalidContextError:       {"CU_FILE_INVALID_CONTEXT_ERROR", "invalid CUDA context"},
	StatusNVFSInternalDriverError:   {"CU_FILE_NVFS_INTERNAL_DRIVER_ERROR", "nvidia-fs internal driver error"},
	StatusBatchNoCompatError:        {"CU_FILE_BATCH_NOCOMPAT_ERROR", "batch I/O not supported in compatibility mode"},
	StatusIOMaxError:                {"CU_FILE_IO_MAX_ERROR", "maximum error code"},
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
	if st == StatusCUDADriverError || cuErr != 0 {
		return fmt.Errorf("%w (%w)", st, cuda.Result(cuErr))
	}
	return st
}

// ioError converts a negative return of cuFileRead or cuFileWrite: -1 means
// errno (given) says what failed; other negative values are -Status.
func ioError(ret int64, errno error) error {
	if ret == -1 {
		if errno == nil {
			return errors.New("cufile: I/O failed with -1 and no errno")
		}
		return fmt.Errorf("cufile: %w", errno)
	}
	return Status(-ret)
}

// asyncError is the error of an asynchronous I/O's byte count ret < 0.
// cuFile's codes start at 5000; between them and -1 (an error whose errno
// an asynchronous I/O cannot leave behind) the count is a negated errno
// (compat mode reported -5, EIO).
func asyncError(ret int64) error {
	if ret < -1 && -ret < 5000 {
		return fmt.Errorf("cufile: asynchronous I/O: %w", syscall.Errno(-ret))
	}
	return ioError(ret, nil)
}
