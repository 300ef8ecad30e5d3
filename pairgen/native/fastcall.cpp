// pairgen's fast call: a module call whose inputs look exactly like the last one's, in compiled code.
//
// At the seed shapes a module call's GPU work (10-27 us) is less than its Python host path: the
// checks, the output allocation and a ctypes driver call cost tens of us per call on the H200
// host. pairgen/fastcall.py records one ordinary call (the kernels it launched, with their
// arguments mapped to "the i-th input's data" (the weights are inputs too), "the output", "this
// call's scratch" or a constant held by the module) and hands the recording here; later calls that
// match it (same shapes, dtypes, device, contiguity; no autograd; the autocast the call ran under;
// pairgen's epoch counters unchanged) run it from C++:
// allocate the output (and scratch) through ATen's caching allocator, write the arguments, launch.
// Anything else returns None and the caller takes the Python path, which records again.
//
// A runner may also note a batched product between its kernels (fastcall.note_product: the 16-bit
// triangle update's cuBLAS bmm) and a copy (fastcall.note_copy: an fp32 input cast to 16 bits under
// autocast); a replay runs them through ATen, in launch order, on views of the same inputs, output
// and per-call buffers.
//
// The driver's launch functions arrive as addresses (libcuda's, or a test's stand-ins), so this
// file needs neither the CUDA headers nor libcuda to build: the CPU-only CI builds and tests it.
#include <Python.h>

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/copy.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
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

enum class Mode { plain = 0, cooperative = 1, programmatic = 2, product = 3, copy = 4 };
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
  std::vector<Slot> slots;  // a product's: its left operand, right operand and output; a copy's: source, destination
  std::vector<std::vector<int64_t>> geometry;  // a product's or copy's: sizes, strides of each tensor
  std::vector<at::ScalarType> dtypes;          // a product's element type; a copy's source's and destination's
};

struct InputCheck {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  int requires_grad = -1;  // a trace's input: 0 or 1 as recorded (which gradients its backward makes); -1 either
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
  int autocast = -1;  // the CUDA autocast dtype it was recorded under; -1: none
  std::vector<Launch> launches;
  std::vector<PyObject*> owned;  // every PyObject above, released with the capsule
};

const char* kCapsuleName = "pairgen.FastCall";

// A capsule's destructor: its T and the Python objects the T keeps.
template <typename T>
void release(PyObject* capsule) {
  auto* held = static_cast<T*>(PyCapsule_GetPointer(capsule, PyCapsule_GetName(capsule)));
  for (PyObject* obj : held->owned) Py_DECREF(obj);
  delete held;
}

PyObject* keep(std::vector<PyObject*>& owned, PyObject* obj) {
  Py_INCREF(obj);
  owned.push_back(obj);
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

// A new T filled by fill(T*), in a capsule named `name`; where fill throws, what it kept (T::owned)
// is released and a ValueError set (or the Python error fill met kept).
template <typename T, typename Fill>
PyObject* build_capsule(const char* name, PyCapsule_Destructor destructor, Fill fill) {
  auto* built = new T();
  try {
    fill(built);
  } catch (const std::exception& e) {
    for (PyObject* obj : built->owned) Py_DECREF(obj);
    delete built;
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
  return PyCapsule_New(built, name, destructor);
}

at::Device parse_device(const char* type, int index) {
  return at::Device(std::string(type) == "cuda" ? at::kCUDA : at::kCPU, static_cast<c10::DeviceIndex>(index));
}

// inputs: ((sizes, dtype), ...), or ((sizes, dtype, requires_grad (-1: either)), ...) for a trace.
std::vector<InputCheck> parse_inputs(PyObject* inputs) {
  std::vector<InputCheck> checks;
  for (Py_ssize_t i = 0; i < PySequence_Size(inputs); ++i) {
    PyObject* spec = PySequence_GetItem(inputs, i);
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 2) {
      Py_DECREF(spec);
      throw std::invalid_argument("an input spec is a tuple (sizes, dtype[, requires_grad])");
    }
    InputCheck check{int_list(PyTuple_GetItem(spec, 0)), scalar_type(PyTuple_GetItem(spec, 1))};
    if (PyTuple_GET_SIZE(spec) > 2) check.requires_grad = static_cast<int>(PyLong_AsLong(PyTuple_GetItem(spec, 2)));
    checks.push_back(std::move(check));
    Py_DECREF(spec);
  }
  return checks;
}

// plain_types: a sequence of tensor subclasses a call takes as plain tensors.
std::vector<PyTypeObject*> parse_plain_types(PyObject* plain_types, std::vector<PyObject*>& owned) {
  std::vector<PyTypeObject*> types;
  for (Py_ssize_t i = 0; i < PySequence_Size(plain_types); ++i) {
    PyObject* type = PySequence_GetItem(plain_types, i);
    if (!PyType_Check(type)) {
      Py_DECREF(type);
      throw std::invalid_argument("plain_types holds types");
    }
    types.push_back(reinterpret_cast<PyTypeObject*>(keep(owned, type)));
    Py_DECREF(type);
  }
  return types;
}

// epochs: ((one-element list, the value it held), ...).
std::vector<Epoch> parse_epochs(PyObject* epochs, std::vector<PyObject*>& owned) {
  std::vector<Epoch> parsed;
  for (Py_ssize_t i = 0; i < PySequence_Size(epochs); ++i) {
    PyObject* spec = PySequence_GetItem(epochs, i);
    PyObject* counter = PyTuple_GetItem(spec, 0);
    if (!PyList_Check(counter) || PyList_GET_SIZE(counter) != 1) {
      Py_DECREF(spec);
      throw std::invalid_argument("an epoch counter is a one-element list");
    }
    parsed.push_back({keep(owned, counter), keep(owned, PyTuple_GetItem(spec, 1))});
    Py_DECREF(spec);
  }
  return parsed;
}

// A launch's kernel and configuration: the first six items of `spec`, (driver function address,
// mode, CUfunction, grid, block, shared bytes).
Launch parse_kernel(PyObject* spec) {
  if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 6) throw std::invalid_argument("a launch spec is a tuple");
  Launch launch;
  launch.function_address = PyLong_AsUnsignedLongLong(PyTuple_GetItem(spec, 0));
  launch.mode = static_cast<Mode>(PyLong_AsLong(PyTuple_GetItem(spec, 1)));
  launch.kernel = PyLong_AsVoidPtr(PyTuple_GetItem(spec, 2));
  launch.grid = PyLong_AsUnsignedLong(PyTuple_GetItem(spec, 3));
  launch.block = PyLong_AsUnsignedLong(PyTuple_GetItem(spec, 4));
  launch.shared_bytes = PyLong_AsUnsignedLong(PyTuple_GetItem(spec, 5));
  return launch;
}

// build(device_type, device_index, inputs, out, scratch_bytes, epochs, launches, plain_types[, autocast])
//   -> capsule
//   inputs: ((sizes, dtype), ...); out: (sizes, dtype);
//   epochs: ((one-element list, value), ...); launches: ((driver function address, mode, CUfunction,
//   grid, block, shared bytes, ((source, value), ...)[, geometry]), ...); autocast: the CUDA
//   autocast dtype the call ran under, None (the default) for none
PyObject* build(PyObject*, PyObject* args) {
  const char* device_type;
  int device_index;
  PyObject *inputs, *out, *epochs, *launches, *plain_types, *autocast = Py_None;
  long long scratch_bytes;
  if (!PyArg_ParseTuple(args, "siOOLOOO|O", &device_type, &device_index, &inputs, &out, &scratch_bytes, &epochs,
                        &launches, &plain_types, &autocast))
    return nullptr;
  return build_capsule<FastCall>(kCapsuleName, release<FastCall>, [&](FastCall* call) {
    call->device = parse_device(device_type, device_index);
    call->inputs = parse_inputs(inputs);
    call->out_sizes = int_list(PyTuple_GetItem(out, 0));
    call->out_dtype = scalar_type(PyTuple_GetItem(out, 1));
    call->scratch_bytes = scratch_bytes;
    call->plain_types = parse_plain_types(plain_types, call->owned);
    call->epochs = parse_epochs(epochs, call->owned);
    if (autocast != Py_None) call->autocast = static_cast<int>(scalar_type(autocast));
    for (Py_ssize_t i = 0; i < PySequence_Size(launches); ++i) {
      PyObject* spec = PySequence_GetItem(launches, i);
      Launch launch = parse_kernel(spec);
      PyObject* slots = PyTuple_GetItem(spec, 6);
      for (Py_ssize_t k = 0; k < PySequence_Size(slots); ++k) {
        PyObject* slot = PySequence_GetItem(slots, k);
        launch.slots.push_back({static_cast<Source>(PyLong_AsLong(PyTuple_GetItem(slot, 0))),
                                PyLong_AsLongLong(PyTuple_GetItem(slot, 1))});
        Py_DECREF(slot);
      }
      if (launch.mode == Mode::product || launch.mode == Mode::copy) {
        // (sizes, strides) per tensor, then the dtypes: a product's one, a copy's two
        const size_t tensors = launch.mode == Mode::product ? 3 : 2, dtypes = launch.mode == Mode::product ? 1 : 2;
        PyObject* geometry = PyTuple_GetItem(spec, 7);
        if (launch.slots.size() != tensors ||
            PySequence_Size(geometry) != static_cast<Py_ssize_t>(2 * tensors + dtypes)) {
          Py_DECREF(spec);
          throw std::invalid_argument("a product takes three tensors and a dtype, a copy two tensors and two dtypes");
        }
        for (size_t k = 0; k < 2 * tensors; ++k) launch.geometry.push_back(int_list(PyTuple_GetItem(geometry, k)));
        for (size_t k = 0; k < dtypes; ++k) launch.dtypes.push_back(scalar_type(PyTuple_GetItem(geometry, 2 * tensors + k)));
      }
      Py_DECREF(spec);
      call->launches.push_back(std::move(launch));
    }
    if (PyErr_Occurred()) throw std::invalid_argument("a malformed fast-call recording");
    if (call->inputs.size() > kMaxInputs) throw std::invalid_argument("too many inputs for a fast call");
    for (const Launch& launch : call->launches)
      if (launch.slots.size() > kMaxArguments) throw std::invalid_argument("too many kernel arguments for a fast call");
  });
}

bool same_sizes(const at::Tensor& t, const std::vector<int64_t>& sizes) {
  auto actual = t.sizes();
  if (actual.size() != sizes.size()) return false;
  for (size_t i = 0; i < sizes.size(); ++i)
    if (actual[i] != sizes[i]) return false;
  return true;
}

// The tensor `obj` holds where it is a plain tensor (or one of `plain_types`: other subclasses'
// __torch_function__ may mean anything) like `want` on `device`, contiguous and 16-byte aligned (the
// kernels read 16-byte vectors); else nullptr: the call takes the Python path.
const at::Tensor* matching_input(PyObject* obj, const std::vector<PyTypeObject*>& plain_types, const InputCheck& want,
                                 const at::Device& device) {
  PyTypeObject* type = Py_TYPE(obj);
  if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) &&
      std::find(plain_types.begin(), plain_types.end(), type) == plain_types.end())
    return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.scalar_type() != want.dtype || t.device() != device || !same_sizes(t, want.sizes) || !t.is_contiguous() ||
      reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 != 0)
    return nullptr;
  return &t;
}

// Whether the recorded call still applies: the epochs and autocast (autograd: the inputs' checks).
// autocast: the CUDA autocast dtype the call was recorded under, -1 for none.
bool module_unchanged(const std::vector<Epoch>& epochs, int autocast = -1) {
  if (at::autocast::is_autocast_enabled(at::kCUDA)
          ? autocast != static_cast<int>(at::autocast::get_autocast_dtype(at::kCUDA))
          : autocast != -1)
    return false;
  for (const Epoch& epoch : epochs)
    if (PyList_GET_ITEM(epoch.counter, 0) != epoch.value &&
        PyObject_RichCompareBool(PyList_GET_ITEM(epoch.counter, 0), epoch.value, Py_EQ) != 1)
      return false;
  return true;
}

// A noted product (out = left @ right) or copy (destination = source) on the recorded views, on the
// current stream of the call's device (the stream the Python path's operation ran on).
void run_noted(const Launch& launch, const int64_t* values, const at::Device& device) {
  auto view = [&](int k, at::ScalarType dtype) {
    return at::from_blob(reinterpret_cast<void*>(values[k]), launch.geometry[2 * k], launch.geometry[2 * k + 1],
                         at::TensorOptions().dtype(dtype).device(device));
  };
  if (launch.mode == Mode::copy) {
    view(1, launch.dtypes[1]).copy_(view(0, launch.dtypes[0]));
    return;
  }
  at::Tensor out = view(2, launch.dtypes[0]);
  at::bmm_out(out, view(0, launch.dtypes[0]), view(1, launch.dtypes[0]));
}

int launch_one(const Launch& launch, void* stream, void** pointers) {
  switch (launch.mode) {
    case Mode::product:
    case Mode::copy:
      return -1;  // run_noted's, not a launch
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

// The T in a replay's first argument (a capsule named `name`), with a stream after it; else nullptr
// with a Python error set (usage: the call's signature, for the TypeError).
template <typename T>
T* capsule_argument(PyObject* const* args, Py_ssize_t nargs, const char* name, const char* usage) {
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError, usage);
    return nullptr;
  }
  return static_cast<T*>(PyCapsule_GetPointer(args[0], name));
}

// call(capsule, stream, *inputs) -> the output, or None: take the Python path.
PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  auto* fast = capsule_argument<FastCall>(args, nargs, kCapsuleName, "call(capsule, stream, *inputs)");
  if (fast == nullptr) return nullptr;
  if (static_cast<size_t>(nargs - 2) != fast->inputs.size()) Py_RETURN_NONE;  // build() bounds it
  bool grad = at::GradMode::is_enabled();
  int64_t input_data[kMaxInputs];
  for (size_t i = 0; i < fast->inputs.size(); ++i) {
    const at::Tensor* t = matching_input(args[2 + i], fast->plain_types, fast->inputs[i], fast->device);
    if (t == nullptr || (grad && t->requires_grad())) Py_RETURN_NONE;
    input_data[i] = reinterpret_cast<int64_t>(t->data_ptr());
  }
  PyObject* result = nullptr;
  try {
    if (!module_unchanged(fast->epochs, fast->autocast)) Py_RETURN_NONE;
    // The noted operations ran in the dtypes they name (the runners cast explicitly).
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
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
      if (launch.mode == Mode::product || launch.mode == Mode::copy) {
        c10::DeviceGuard guard(fast->device);
        run_noted(launch, values, fast->device);
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

// ---- traces: a closed form's training forward, or its backward, replayed whole ----------------------
//
// pairgen/replay.py records a training call's forward and then its backward on the Python path: every
// kernel launch and every PyTorch operation, in order, each tensor and pointer located in one of the
// call's inputs or in a buffer the call allocated ("born"), so that the Python of a step (hundreds of
// calls, tens of µs a launch) becomes one compiled walk. A replay allocates each born buffer before the
// step that first touches it and drops it after the last (unless an output views it), as the Python
// path's tensors live and die, runs the steps on the current stream, and returns the outputs as views
// of its inputs and buffers.

enum class StepKind { launch = 0, bmm = 1, mm = 2, sum = 3, copy = 4, cat = 5, zero = 6, fill = 7 };

struct Place {     // where a pointer or a tensor's data lies
  int32_t buffer;  // an input's index, then the born buffers' (n_inputs + k); -1: a constant
  int64_t value;   // the constant, or the byte offset into the buffer
};

struct TensorRef {
  Place place;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kByte;
};

struct Step {
  StepKind kind;
  Launch launch;                   // a launch's kernel and configuration
  std::vector<Place> args;         // a launch's arguments
  std::vector<TensorRef> tensors;  // an operation's tensors: what it writes first, then what it reads
  std::vector<int64_t> dims;       // sum: the dims summed; cat: {the dim}
  bool keepdim = false;
  double value = 0;                         // fill's
  std::vector<int32_t> allocate;  // born buffers (their index among the born) made before this step
  std::vector<int32_t> release;   // buffers (born, or inputs the call consumes) dropped after it
};

struct Trace {
  at::Device device{at::kCPU};
  std::vector<PyTypeObject*> plain_types;
  std::vector<InputCheck> inputs;
  std::vector<int64_t> born_bytes;
  std::vector<Step> steps;
  std::vector<TensorRef> outputs;  // place.buffer -1: None
  std::vector<Epoch> epochs;
  PyObject* make_current = nullptr;  // makes the device's context current on a thread that has none
  int autocast = -1;                 // the CUDA autocast dtype it was recorded under; -1: none
  size_t state_outputs = 0;          // the last this-many outputs are returned in one State
  size_t state_inputs = 0;           // the last this-many inputs come in a State (the last argument), consumed
  std::vector<PyObject*> owned;
};

const char* kTraceName = "pairgen.Trace";

// Buffers one trace hands to another and nobody else holds (a forward's kept intermediates for its
// backward): the backward takes them out, so that each is freed after its last use there, as the
// Python path frees its saved intermediates while its backward runs.
struct State {
  std::vector<at::Tensor> tensors;
};

const char* kStateName = "pairgen.TraceState";

void release_state(PyObject* capsule) {
  delete static_cast<State*>(PyCapsule_GetPointer(capsule, kStateName));
}


Place parse_place(PyObject* pair) {
  if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) throw std::invalid_argument("a place is a pair");
  return {static_cast<int32_t>(PyLong_AsLong(PyTuple_GetItem(pair, 0))), PyLong_AsLongLong(PyTuple_GetItem(pair, 1))};
}

// (buffer, byte offset, sizes, strides, dtype), or None.
TensorRef parse_tensor(PyObject* spec) {
  TensorRef ref;
  if (spec == Py_None) {
    ref.place = {-1, 0};
    return ref;
  }
  if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 5) throw std::invalid_argument("a tensor spec is a 5-tuple");
  ref.place = {static_cast<int32_t>(PyLong_AsLong(PyTuple_GetItem(spec, 0))), PyLong_AsLongLong(PyTuple_GetItem(spec, 1))};
  ref.sizes = int_list(PyTuple_GetItem(spec, 2));
  ref.strides = int_list(PyTuple_GetItem(spec, 3));
  ref.dtype = scalar_type(PyTuple_GetItem(spec, 4));
  return ref;
}

std::vector<int32_t> int32_list(PyObject* seq) {
  std::vector<int32_t> values;
  for (int64_t v : int_list(seq)) values.push_back(static_cast<int32_t>(v));
  return values;
}

// (kind, kernel spec or None, ((buffer, value), ...), (tensor spec, ...), dims, keepdim, value,
//  allocate, release)
Step parse_step(PyObject* spec) {
  if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 9) throw std::invalid_argument("a step is a 9-tuple");
  Step step;
  step.kind = static_cast<StepKind>(PyLong_AsLong(PyTuple_GetItem(spec, 0)));
  if (step.kind == StepKind::launch) step.launch = parse_kernel(PyTuple_GetItem(spec, 1));
  PyObject* args = PyTuple_GetItem(spec, 2);
  for (Py_ssize_t k = 0; k < PySequence_Size(args); ++k) {
    PyObject* pair = PySequence_GetItem(args, k);
    step.args.push_back(parse_place(pair));
    Py_DECREF(pair);
  }
  PyObject* tensors = PyTuple_GetItem(spec, 3);
  for (Py_ssize_t k = 0; k < PySequence_Size(tensors); ++k) {
    PyObject* tensor = PySequence_GetItem(tensors, k);
    step.tensors.push_back(parse_tensor(tensor));
    Py_DECREF(tensor);
  }
  step.dims = int_list(PyTuple_GetItem(spec, 4));
  step.keepdim = PyObject_IsTrue(PyTuple_GetItem(spec, 5)) == 1;
  step.value = PyFloat_AsDouble(PyTuple_GetItem(spec, 6));
  step.allocate = int32_list(PyTuple_GetItem(spec, 7));
  step.release = int32_list(PyTuple_GetItem(spec, 8));
  return step;
}

// Whether every place a step or output names lies in the trace's buffers, and each step has what
// its kind reads: a malformed recording is refused at build, never followed at a call.
void check_trace(const Trace& trace) {
  const int64_t buffers = static_cast<int64_t>(trace.inputs.size() + trace.born_bytes.size());
  auto inside = [&](const Place& place) { return place.buffer >= -1 && place.buffer < buffers; };
  static const size_t operands[] = {0, 3, 3, 2, 2, 2, 1, 1};  // tensors each kind takes (cat: at least)
  for (const Step& step : trace.steps) {
    const auto kind = static_cast<size_t>(step.kind);
    if (kind > static_cast<size_t>(StepKind::fill)) throw std::invalid_argument("an unknown step");
    if (step.kind == StepKind::launch ? step.args.size() > kMaxArguments : step.tensors.size() < operands[kind])
      throw std::invalid_argument("a step with the wrong number of operands");
    for (const Place& place : step.args)
      if (!inside(place)) throw std::invalid_argument("a launch argument outside the trace's buffers");
    for (const TensorRef& ref : step.tensors)
      if (ref.place.buffer < 0 || !inside(ref.place)) throw std::invalid_argument("a tensor outside the trace's buffers");
    for (int32_t born : step.allocate)
      if (born < 0 || born >= static_cast<int32_t>(trace.born_bytes.size()))
        throw std::invalid_argument("a born buffer that does not exist");
    const auto consumed = static_cast<int32_t>(trace.inputs.size() - trace.state_inputs);
    for (int32_t buffer : step.release)
      if (buffer < consumed || buffer >= buffers)  // an input's buffer is the caller's unless it came in a State
        throw std::invalid_argument("a released buffer the replay does not own");
  }
  for (const TensorRef& ref : trace.outputs)
    if (!inside(ref.place)) throw std::invalid_argument("an output outside the trace's buffers");
  if (trace.inputs.size() > kMaxInputs) throw std::invalid_argument("too many inputs for a trace");
  if (trace.state_inputs > trace.inputs.size() || trace.state_outputs > trace.outputs.size())
    throw std::invalid_argument("a State larger than the inputs or outputs");
}

// build_trace(device_type, device_index, inputs, born_bytes, steps, outputs, epochs, plain_types,
//             make_current, autocast, state_outputs, state_inputs) -> capsule
//   inputs: ((sizes, dtype, requires_grad (-1: either)), ...); born_bytes: (bytes, ...);
//   steps: see parse_step; outputs: (tensor spec or None, ...); autocast: a dtype or None;
//   state_outputs / state_inputs: see Trace
PyObject* build_trace(PyObject*, PyObject* args) {
  const char* device_type;
  int device_index;
  PyObject *inputs, *born_bytes, *steps, *outputs, *epochs, *plain_types, *make_current, *autocast;
  Py_ssize_t state_outputs, state_inputs;
  if (!PyArg_ParseTuple(args, "siOOOOOOOOnn", &device_type, &device_index, &inputs, &born_bytes, &steps, &outputs,
                        &epochs, &plain_types, &make_current, &autocast, &state_outputs, &state_inputs))
    return nullptr;
  if (state_outputs < 0 || state_inputs < 0) {
    PyErr_SetString(PyExc_ValueError, "a State's size is not negative");
    return nullptr;
  }
  return build_capsule<Trace>(kTraceName, release<Trace>, [&](Trace* trace) {
    trace->device = parse_device(device_type, device_index);
    trace->inputs = parse_inputs(inputs);
    trace->born_bytes = int_list(born_bytes);
    for (Py_ssize_t i = 0; i < PySequence_Size(steps); ++i) {
      PyObject* spec = PySequence_GetItem(steps, i);
      trace->steps.push_back(parse_step(spec));
      Py_DECREF(spec);
    }
    for (Py_ssize_t i = 0; i < PySequence_Size(outputs); ++i) {
      PyObject* spec = PySequence_GetItem(outputs, i);
      trace->outputs.push_back(parse_tensor(spec));
      Py_DECREF(spec);
    }
    trace->epochs = parse_epochs(epochs, trace->owned);
    trace->plain_types = parse_plain_types(plain_types, trace->owned);
    trace->make_current = keep(trace->owned, make_current);
    if (autocast != Py_None) trace->autocast = static_cast<int>(scalar_type(autocast));
    trace->state_outputs = static_cast<size_t>(state_outputs);
    trace->state_inputs = static_cast<size_t>(state_inputs);
    if (PyErr_Occurred()) throw std::invalid_argument("a malformed trace");
    check_trace(*trace);
  });
}

// What a replay holds while it runs: each buffer's base address, and the tensor that owns it.
struct Buffers {
  std::vector<int64_t> base;
  std::vector<at::Tensor> owner;
  std::vector<int64_t> owner_offset;  // the base's byte offset in its owner's storage

  int64_t address(const Place& place) const {
    return place.buffer < 0 ? place.value : base[place.buffer] + place.value;
  }
};

at::Tensor view(const TensorRef& ref, const Buffers& buffers, const at::Device& device) {
  return at::from_blob(reinterpret_cast<void*>(buffers.address(ref.place)), ref.sizes, ref.strides,
                       at::TensorOptions().dtype(ref.dtype).device(device));
}

// An output: a view of its buffer's storage that keeps the storage alive.
at::Tensor output_view(const TensorRef& ref, const Buffers& buffers, const at::Device& device) {
  const int64_t item = static_cast<int64_t>(c10::elementSize(ref.dtype));
  const int64_t bytes = buffers.owner_offset[ref.place.buffer] + ref.place.value;
  if (bytes % item != 0) throw std::runtime_error("pairgen: a trace's output is not aligned to its dtype");
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(ref.dtype).device(device));
  out.set_(buffers.owner[ref.place.buffer].storage(), bytes / item, ref.sizes, ref.strides);
  return out;
}

void run_operation(const Step& step, const Buffers& buffers, const at::Device& device) {
  at::Tensor out = view(step.tensors[0], buffers, device);
  switch (step.kind) {
    case StepKind::bmm: at::bmm_out(out, view(step.tensors[1], buffers, device), view(step.tensors[2], buffers, device)); break;
    case StepKind::mm: at::mm_out(out, view(step.tensors[1], buffers, device), view(step.tensors[2], buffers, device)); break;
    case StepKind::sum:
      at::sum_out(out, view(step.tensors[1], buffers, device), step.dims, step.keepdim, out.scalar_type());
      break;
    case StepKind::copy: out.copy_(view(step.tensors[1], buffers, device)); break;
    case StepKind::cat: {
      std::vector<at::Tensor> parts;
      for (size_t k = 1; k < step.tensors.size(); ++k) parts.push_back(view(step.tensors[k], buffers, device));
      at::cat_out(out, parts, step.dims.at(0));
      break;
    }
    case StepKind::zero: out.zero_(); break;
    case StepKind::fill: out.fill_(step.value); break;
    case StepKind::launch: break;
  }
}

// Launch one recorded kernel; a thread without a CUDA context (autograd's worker, before anything
// else touched the device there) gets the device's made current, once, and the launch again.
void run_launch(const Step& step, const Buffers& buffers, void* stream, PyObject* make_current, size_t index) {
  int64_t values[kMaxArguments];
  void* pointers[kMaxArguments];
  for (size_t k = 0; k < step.args.size(); ++k) {
    values[k] = buffers.address(step.args[k]);
    pointers[k] = &values[k];
  }
  int code = launch_one(step.launch, stream, pointers);
  if (code == kInvalidContext) {
    PyObject* made = PyObject_CallNoArgs(make_current);
    if (made == nullptr) throw std::runtime_error("pairgen: making the device's context current failed");
    Py_DECREF(made);
    code = launch_one(step.launch, stream, pointers);
  }
  if (code != 0)
    throw std::runtime_error("pairgen: launch " + std::to_string(index) + " of a replayed trace failed (CUresult " +
                             std::to_string(code) + ")");
}

// A replay's outputs: views of its buffers, None where the recording had none, the last
// state_outputs of them (whole buffers) in one State.
PyObject* trace_outputs(const Trace& trace, const Buffers& buffers) {
  const size_t views = trace.outputs.size() - trace.state_outputs;
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(views + (trace.state_outputs > 0 ? 1 : 0)));
  if (result == nullptr) return nullptr;
  for (size_t k = 0; k < views; ++k) {
    const TensorRef& ref = trace.outputs[k];
    PyObject* item = ref.place.buffer < 0 ? (Py_INCREF(Py_None), Py_None)
                                          : THPVariable_Wrap(output_view(ref, buffers, trace.device));
    PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(k), item);
  }
  if (trace.state_outputs > 0) {
    auto* state = new State();
    for (size_t k = views; k < trace.outputs.size(); ++k) state->tensors.push_back(buffers.owner[trace.outputs[k].place.buffer]);
    PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(views), PyCapsule_New(state, kStateName, release_state));
  }
  return result;
}

// The State a call passes last, holding `count` byte buffers of the sizes `checks` name; else nullptr.
State* matching_state(PyObject* obj, const std::vector<InputCheck>& checks, size_t first, size_t count,
                      const at::Device& device) {
  if (!PyCapsule_IsValid(obj, kStateName)) return nullptr;
  auto* state = static_cast<State*>(PyCapsule_GetPointer(obj, kStateName));
  if (state->tensors.size() != count) return nullptr;  // another trace's, or consumed already
  for (size_t k = 0; k < count; ++k) {
    const at::Tensor& t = state->tensors[k];
    if (t.device() != device || !same_sizes(t, checks[first + k].sizes)) return nullptr;
  }
  return state;
}

// run_trace(capsule, stream, *inputs[, state]) -> the outputs (a tuple; None where the recording had
// none; the last ones in a State where the trace keeps some for another), or None: the inputs or
// pairgen's state differ from the recording's, take the Python path (a State passed is left whole).
PyObject* run_trace(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  auto* trace = capsule_argument<Trace>(args, nargs, kTraceName, "run_trace(capsule, stream, *inputs[, state])");
  if (trace == nullptr) return nullptr;
  const size_t n_inputs = trace->inputs.size(), given = n_inputs - trace->state_inputs;
  if (static_cast<size_t>(nargs - 2) != given + (trace->state_inputs > 0 ? 1 : 0)) Py_RETURN_NONE;
  Buffers buffers;
  buffers.base.resize(n_inputs + trace->born_bytes.size());
  buffers.owner.resize(buffers.base.size());
  buffers.owner_offset.assign(buffers.base.size(), 0);
  for (size_t i = 0; i < given; ++i) {
    const InputCheck& want = trace->inputs[i];
    const at::Tensor* t = matching_input(args[2 + i], trace->plain_types, want, trace->device);
    if (t == nullptr || (want.requires_grad >= 0 && t->requires_grad() != (want.requires_grad == 1))) Py_RETURN_NONE;
    buffers.base[i] = reinterpret_cast<int64_t>(t->data_ptr());
    buffers.owner[i] = *t;
    buffers.owner_offset[i] = t->storage_offset() * static_cast<int64_t>(t->element_size());
  }
  State* state = nullptr;
  if (trace->state_inputs > 0) {
    state = matching_state(args[2 + given], trace->inputs, given, trace->state_inputs, trace->device);
    if (state == nullptr) Py_RETURN_NONE;
  }
  if (!module_unchanged(trace->epochs, trace->autocast)) Py_RETURN_NONE;
  if (state != nullptr) {  // taken out: from here the replay holds the only reference to each
    for (size_t k = 0; k < trace->state_inputs; ++k) {
      buffers.owner[given + k] = std::move(state->tensors[k]);
      buffers.base[given + k] = reinterpret_cast<int64_t>(buffers.owner[given + k].data_ptr());
    }
    state->tensors.clear();
  }
  try {
    // The recorded operations ran in the dtypes they name (the closed form turns autocast off).
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    at::NoGradGuard no_grad;
    c10::DeviceGuard guard(trace->device);
    void* stream = PyLong_AsVoidPtr(args[1]);
    const auto bytes = at::TensorOptions().dtype(at::kByte).device(trace->device);
    for (size_t n = 0; n < trace->steps.size(); ++n) {
      const Step& step = trace->steps[n];
      for (int32_t born : step.allocate) {
        const size_t b = n_inputs + born;
        buffers.owner[b] = at::empty({trace->born_bytes[born]}, bytes);
        buffers.base[b] = reinterpret_cast<int64_t>(buffers.owner[b].data_ptr());
      }
      if (step.kind == StepKind::launch)
        run_launch(step, buffers, stream, trace->make_current, n);
      else
        run_operation(step, buffers, trace->device);
      for (int32_t buffer : step.release) buffers.owner[buffer].reset();
    }
    return trace_outputs(*trace, buffers);
  } catch (const std::exception& e) {  // a failed launch or allocation (out of memory)
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef methods[] = {
    {"build", build, METH_VARARGS, "A recorded call's capsule (see pairgen/fastcall.py)."},
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(call)), METH_FASTCALL,
     "Run a recorded call on new inputs: the output, or None where the recording does not apply."},
    {"build_trace", build_trace, METH_VARARGS, "A recorded trace's capsule (see pairgen/replay.py)."},
    {"run_trace", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(run_trace)), METH_FASTCALL,
     "Run a recorded trace on new inputs: its outputs, or None where the recording does not apply."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "pairgen_fastcall", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_pairgen_fastcall(void) { return PyModule_Create(&module_def); }
