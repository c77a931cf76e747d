#include "dialect.h"
#include "gated_delta_steps.h"
