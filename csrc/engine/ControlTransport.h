#pragma once

namespace smfree::engine {

// The control transport as the progress loop drives it: progress its worker, hand over the
// control messages that arrived, and sleep on its event fd until one comes or another thread
// signals. Implemented by UcxControl (whose worker UcxChannel shares); the engine's C++ tests
// give their own.
class ControlTransport {
 public:
  virtual ~ControlTransport() = default;

  // Progress thread: one step of the worker's progress; how many events it handled.
  virtual unsigned progress() = 0;
  // Progress thread: hands the messages that arrived since the last call to the handler, in
  // arrival order, outside the worker's progress; whether there were any.
  virtual bool deliver() = 0;
  // Progress thread: readies the event fd for a sleep; false where events are already pending
  // (progress again first).
  virtual bool arm() = 0;
  virtual int eventFd() const = 0;
  // Any thread: fires the armed event fd, waking the progress thread from its sleep.
  virtual void signal() = 0;
};

}  // namespace smfree::engine
