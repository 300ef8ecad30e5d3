// pairgen's fast call: a module call whose inputs look exactly like the last one's, in compiled code.
//
// At the seed shapes a module call's GPU work (10-27 us) is less than its Python host path: the
// checks, the output allocation and a ctypes driver call cost tens of us per call on the H200
// host. pairgen/fastcall.py records one ordinary call (the kernels it launched, with their
// arguments mapped to "the i-th input's data" (the weights are inputs too), "the output", "this
// call's scratch" or a constant held by the module) and hands the recording here; later calls that
// match it (same shapes, dtypes, device, contiguity; no autograd, no autocast; pairgen's epoch
// counters unchanged) run it from C++:
// allocate the output (and scratch) through ATen's caching allocator, write the arguments, launch.
// Anything else returns None and the caller takes the Python path, which records again.
//
// A runner may also note a batched product between its kernels (fastcall.note_product: the 16-bit
// triangle update's cuBLAS bmm); a replay runs it through ATen, in launch order, on views of the
// same inputs, output and per-call buffers.
//
// The driver's launch functions arrive as addresses (libcuda's, or a test's stand-ins), so this
// file needs neither the CUDA headers nor libcuda to build: the CPU-only CI builds and tests it.
#include <Python.h>

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace {

// CUlaunchAttribute / CUlaunchConfig as cuda.h (CUDA 12+) lays them out.
struct LaunchAttribute {
  int id;
  char pad[4];
  char value[64];
};
struct LaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  void* stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};
using LaunchKernel = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             void*, void**, void**);
using LaunchCooperative = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  void*, void**);
using LaunchKernelEx = int (*)(const LaunchConfig*, void*, void**, void**);

constexpr int kProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
constexpr int kInvalidContext = 201;                 // CUDA_ERROR_INVALID_CONTEXT
constexpr size_t kMaxArguments = 64, kMaxInputs = 32;  // per kernel, per call (a call's inputs carry its weights)

enum class Mode { plain = 0, cooperative = 1, programmatic = 2, product = 3 };
// Where a kernel argument comes from on each call.
enum class Source { constant = 0, input = 1, output = 2, scratch = 3 };

struct Slot {
  Source source;
  int64_t value;  // the constant; the input's index; the byte offset into the output or the scratch
};

struct Launch {
  std::uintptr_t function_address;  // the driver entry point for this mode
  Mode mode;
  void* kernel;  // the CUfunction
  unsigned grid, block, shared_bytes;
  std::vector<Slot> slots;  // a product's: its left operand, right operand and output
  std::vector<std::vector<int64_t>> geometry;  // a product's: sizes, strides of each of the three
  at::ScalarType dtype = at::kFloat;           // a product's element type
};

struct InputCheck {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
};

struct Epoch {  // one of pairgen's counters: a one-element list and the value it held
  PyObject* counter;
  PyObject* value;
};

struct FastCall {
  at::Device device{at::kCPU};
  std::vector<PyTypeObject*> plain_types;  // tensor subclasses taken as plain tensors (nn.Parameter)
  std::vector<InputCheck> inputs;
  std::vector<int64_t> out_sizes;
  at::ScalarType out_dtype;
  int64_t scratch_bytes = 0;
  std::vector<Epoch> epochs;
  std::vector<Launch> launches;
  std::vector<PyObject*> owned;  // every PyObject above, released with the capsule
};

const char* kCapsuleName = "pairgen.FastCall";

void release(PyObject* capsule) {
  auto* call = static_cast<FastCall*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  for (PyObject* obj : call->owned) Py_DECREF(obj);
  delete call;
}

PyObject* keep(FastCall* call, PyObject* obj) {
  Py_INCREF(obj);
  call->owned.push_back(obj);
  return obj;
}

std::vector<int64_t> int_list(PyObject* seq) {
  std::vector<int64_t> values;
  Py_ssize_t n = PySequence_Size(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_GetItem(seq, i);
    values.push_back(PyLong_AsLongLong(item));
    Py_DECREF(item);
  }
  return values;
}

at::ScalarType scalar_type(PyObject* dtype) {
  if (!THPDtype_Check(dtype)) throw std::invalid_argument("expected a torch.dtype");
  return reinterpret_cast<THPDtype*>(dtype)->scalar_type;
}

// build(device_type, device_index, inputs, out, scratch_bytes, epochs, launches, plain_types) -> capsule
//   inputs: ((sizes, dtype), ...); out: (sizes, dtype);
//   epochs: ((one-element list, value), ...); launches: ((driver function address, mode, CUfunction,
//   grid, block, shared bytes, ((source, value), ...)), ...)
PyObject* build(PyObject*, PyObject* args) {
  const char* device_type;
  int device_index;
  PyObject *inputs, *out, *epochs, *launches, *plain_types;
  long long scratch_bytes;
  if (!PyArg_ParseTuple(args, "siOOLOOO", &device_type, &device_index, &inputs, &out, &scratch_bytes, &epochs,
                        &launches, &plain_types))
    return nullptr;
  auto* call = new FastCall();
  try {
    call->device = at::Device(std::string(device_type) == "cuda" ? at::kCUDA : at::kCPU,
                              static_cast<c10::DeviceIndex>(device_index));
    for (Py_ssize_t i = 0; i < PySequence_Size(inputs); ++i) {
      PyObject* spec = PySequence_GetItem(inputs, i);
      call->inputs.push_back({int_list(PyTuple_GetItem(spec, 0)), scalar_type(PyTuple_GetItem(spec, 1))});
      Py_DECREF(spec);
    }
    call->out_sizes = int_list(PyTuple_GetItem(out, 0));
    call->out_dtype = scalar_type(PyTuple_GetItem(out, 1));
    call->scratch_bytes = scratch_bytes;
    for (Py_ssize_t i = 0; i < PySequence_Size(plain_types); ++i) {
      PyObject* type = PySequence_GetItem(plain_types, i);
      if (!PyType_Check(type)) {
        Py_DECREF(type);
        throw std::invalid_argument("plain_types holds types");
      }
      call->plain_types.push_back(reinterpret_cast<PyTypeObject*>(keep(call, type)));
      Py_DECREF(type);
    }
    for (Py_ssize_t i = 0; i < PySequence_Size(epochs); ++i) {
      PyObject* spec = PySequence_GetItem(epochs, i);
      PyObject* counter = PyTuple_GetItem(spec, 0);
      if (!PyList_Check(counter) || PyList_GET_SIZE(counter) != 1) {
        Py_DECREF(spec);
        throw std::invalid_argument("an epoch counter is a one-element list");
      }
      call->epochs.push_back({keep(call, counter), keep(call, PyTuple_GetItem(spec, 1))});
      Py_DECREF(spec);
    }
    for (Py_ssize_t i = 0; i < PySequence_Size(launches); ++i) {
      PyObject* spec = PySequence_GetItem(launches, i);
      Launch launch;
      launch.function_address = PyLong_AsUnsignedLongLong(PyTuple_GetItem(spec, 0));
      launch.mode = static_cast<Mode>(PyLong_AsLong(PyTuple_GetItem(spec, 1)));
      launch.kernel = PyLong_AsVoidPtr(PyTuple_GetItem(spec, 2));
      launch.grid = PyLong_AsUnsignedLong(PyTuple_GetItem(spec, 3));
      launch.block = PyLong_AsUnsignedLong(PyTuple_GetItem(spec, 4));
      launch.shared_bytes = PyLong_AsUnsignedLong(PyTuple_GetItem(spec, 5));
      PyObject* slots = PyTuple_GetItem(spec, 6);
      for (Py_ssize_t k = 0; k < PySequence_Size(slots); ++k) {
        PyObject* slot = PySequence_GetItem(slots, k);
        launch.slots.push_back({static_cast<Source>(PyLong_AsLong(PyTuple_GetItem(slot, 0))),
                                PyLong_AsLongLong(PyTuple_GetItem(slot, 1))});
        Py_DECREF(slot);
      }
      if (launch.mode == Mode::product) {  // (sizes, strides) x 3, then the dtype
        PyObject* geometry = PyTuple_GetItem(spec, 7);
        if (launch.slots.size() != 3 || PySequence_Size(geometry) != 7) {
          Py_DECREF(spec);
          throw std::invalid_argument("a product takes three tensors");
        }
        for (Py_ssize_t k = 0; k < 6; ++k) launch.geometry.push_back(int_list(PyTuple_GetItem(geometry, k)));
        launch.dtype = scalar_type(PyTuple_GetItem(geometry, 6));
      }
      Py_DECREF(spec);
      call->launches.push_back(std::move(launch));
    }
    if (PyErr_Occurred()) throw std::invalid_argument("a malformed fast-call recording");
    if (call->inputs.size() > kMaxInputs) throw std::invalid_argument("too many inputs for a fast call");
    for (const Launch& launch : call->launches)
      if (launch.slots.size() > kMaxArguments) throw std::invalid_argument("too many kernel arguments for a fast call");
  } catch (const std::exception& e) {
    for (PyObject* obj : call->owned) Py_DECREF(obj);
    delete call;
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
  return PyCapsule_New(call, kCapsuleName, release);
}

bool same_sizes(const at::Tensor& t, const std::vector<int64_t>& sizes) {
  auto actual = t.sizes();
  if (actual.size() != sizes.size()) return false;
  for (size_t i = 0; i < sizes.size(); ++i)
    if (actual[i] != sizes[i]) return false;
  return true;
}

// Whether the recorded call still applies: the epochs and autocast (autograd: the inputs' checks).
bool module_unchanged(const FastCall& call) {
  if (at::autocast::is_autocast_enabled(at::kCUDA)) return false;
  for (const Epoch& epoch : call.epochs)
    if (PyList_GET_ITEM(epoch.counter, 0) != epoch.value &&
        PyObject_RichCompareBool(PyList_GET_ITEM(epoch.counter, 0), epoch.value, Py_EQ) != 1)
      return false;
  return true;
}

// A noted product: out = left @ right on the recorded views, on the current stream of the
// call's device (the stream the Python path's torch.bmm ran on).
void run_product(const Launch& launch, const int64_t* values, const at::Device& device) {
  auto options = at::TensorOptions().dtype(launch.dtype).device(device);
  auto view = [&](int k) {
    return at::from_blob(reinterpret_cast<void*>(values[k]), launch.geometry[2 * k], launch.geometry[2 * k + 1],
                         options);
  };
  at::Tensor out = view(2);
  at::bmm_out(out, view(0), view(1));
}

int launch_one(const Launch& launch, void* stream, void** pointers) {
  switch (launch.mode) {
    case Mode::product:
      return -1;  // run_product's, not a launch
    case Mode::plain:
      return reinterpret_cast<LaunchKernel>(launch.function_address)(
          launch.kernel, launch.grid, 1, 1, launch.block, 1, 1, launch.shared_bytes, stream, pointers, nullptr);
    case Mode::cooperative:
      return reinterpret_cast<LaunchCooperative>(launch.function_address)(
          launch.kernel, launch.grid, 1, 1, launch.block, 1, 1, launch.shared_bytes, stream, pointers);
    case Mode::programmatic: {
      LaunchAttribute attribute{};
      attribute.id = kProgrammaticStreamSerialization;
      attribute.value[0] = 1;  // programmaticStreamSerializationAllowed
      LaunchConfig config{launch.grid, 1, 1, launch.block, 1, 1, launch.shared_bytes, stream, &attribute, 1};
      return reinterpret_cast<LaunchKernelEx>(launch.function_address)(&config, launch.kernel, pointers, nullptr);
    }
  }
  return -1;
}

// call(capsule, stream, *inputs) -> the output, or None: take the Python path.
PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError, "call(capsule, stream, *inputs)");
    return nullptr;
  }
  auto* fast = static_cast<FastCall*>(PyCapsule_GetPointer(args[0], kCapsuleName));
  if (fast == nullptr) return nullptr;
  if (static_cast<size_t>(nargs - 2) != fast->inputs.size()) Py_RETURN_NONE;  // build() bounds it
  bool grad = at::GradMode::is_enabled();
  int64_t input_data[kMaxInputs];
  for (size_t i = 0; i < fast->inputs.size(); ++i) {
    PyObject* obj = args[2 + i];
    PyTypeObject* type = Py_TYPE(obj);
    if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) &&
        std::find(fast->plain_types.begin(), fast->plain_types.end(), type) == fast->plain_types.end())
      Py_RETURN_NONE;  // other subclasses (their __torch_function__ may mean anything): Python
    const at::Tensor& t = THPVariable_Unpack(obj);
    const InputCheck& want = fast->inputs[i];
    if (t.scalar_type() != want.dtype || t.device() != fast->device || !same_sizes(t, want.sizes) ||
        !t.is_contiguous() || (grad && t.requires_grad()))
      Py_RETURN_NONE;
    auto address = reinterpret_cast<std::uintptr_t>(t.data_ptr());
    if (address % 16 != 0) Py_RETURN_NONE;  // the kernels read 16-byte vectors
    input_data[i] = static_cast<int64_t>(address);
  }
  PyObject* result = nullptr;
  try {
    if (!module_unchanged(*fast)) Py_RETURN_NONE;
    auto options = at::TensorOptions().dtype(fast->out_dtype).device(fast->device);
    at::Tensor out = at::empty(fast->out_sizes, options);
    at::Tensor scratch;
    int64_t scratch_data = 0;
    if (fast->scratch_bytes > 0) {
      scratch = at::empty({fast->scratch_bytes}, at::TensorOptions().dtype(at::kByte).device(fast->device));
      scratch_data = reinterpret_cast<int64_t>(scratch.data_ptr());
    }
    auto out_data = reinterpret_cast<int64_t>(out.data_ptr());
    void* stream = PyLong_AsVoidPtr(args[1]);
    for (size_t n = 0; n < fast->launches.size(); ++n) {
      const Launch& launch = fast->launches[n];
      size_t count = launch.slots.size();
      int64_t values[kMaxArguments];
      void* pointers[kMaxArguments];
      for (size_t k = 0; k < count; ++k) {
        const Slot& slot = launch.slots[k];
        switch (slot.source) {
          case Source::constant: values[k] = slot.value; break;
          case Source::input: values[k] = input_data[slot.value]; break;
          case Source::output: values[k] = out_data + slot.value; break;
          case Source::scratch: values[k] = scratch_data + slot.value; break;
        }
        pointers[k] = &values[k];  // the driver reads each parameter's own size from its slot
      }
      if (launch.mode == Mode::product) {
        c10::DeviceGuard guard(fast->device);
        run_product(launch, values, fast->device);
        continue;
      }
      int code = launch_one(launch, stream, pointers);
      if (code == kInvalidContext && n == 0) Py_RETURN_NONE;  // a thread without a context: Python sets it
      if (code != 0) {
        PyErr_Format(PyExc_RuntimeError, "pairgen: launch %d of a fast call failed (CUresult %d)", (int)n, code);
        return nullptr;
      }
    }
    result = THPVariable_Wrap(std::move(out));
  } catch (const std::exception& e) {  // an allocation that failed (out of memory)
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return result;
}

PyMethodDef methods[] = {
    {"build", build, METH_VARARGS, "A recorded call's capsule (see pairgen/fastcall.py)."},
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(call)), METH_FASTCALL,
     "Run a recorded call on new inputs: the output, or None where the recording does not apply."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "pairgen_fastcall", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_pairgen_fastcall(void) { return PyModule_Create(&module_def); }
