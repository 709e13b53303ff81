// What every response of the server carries and how it is logged: the request id
// (X-Request-Id) and the access log line (openai_server.h's header comment has the contract).
#pragma once

#include <httplib.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace simpler::serve {

// The client's X-Request-Id when it is 1 to 128 printable ASCII characters (0x21-0x7E), else a
// new "req-" id. Thread-safe.
std::string request_id_for(std::string_view sent);

// One request's access record, from its headers read to its response written. cpp-httplib 0.11
// answers a request on one thread, from its pre-routing handler through its handler and content
// provider to its logger, so the record is the calling thread's (one request at a time per
// thread): begin() in the pre-routing handler, note_tokens() by a completion handler or its
// content provider, take() in the logger. Owner-thread only.
struct AccessRecord {
  bool begun = false;  // false: the request was refused before routing (a malformed request line)
  int64_t start_ns = 0;
  int64_t prompt_tokens = -1;  // -1: not known
  int64_t completion_tokens = -1;
  bool client_disconnected = false;  // the client left before its response was whole

  // The calling thread's record.
  static AccessRecord& current();
  // Starts the calling thread's record for a new request.
  static void begin();
  // Records the token counts of the calling thread's request.
  static void note_tokens(int64_t prompt, int64_t completion);
  // Records that the calling thread's request lost its client before its response was whole.
  static void note_client_disconnected();
  // The calling thread's record, which is reset.
  static AccessRecord take();
};

// The access log line of a response: "METHOD PATH STATUS prompt_tokens=P completion_tokens=C
// ms=T request_id=ID", then " client_disconnected" when the client left before the response was
// whole (`-` for counts not known; method and path at most 100 bytes, other than printable ASCII
// as '?'). Thread-safe (pure).
std::string access_line(std::string_view method, std::string_view path, int status,
                        const AccessRecord& record, int64_t end_ns, std::string_view request_id);

}  // namespace simpler::serve
